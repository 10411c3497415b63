"""The planner's loop on a live server (real Ray actors, UCX, gRPC on the CPU): not in dry-run,
with an aggressive config and a profile whose prefills are slow, a stream of greedy requests
makes it move a decode worker to prefill. The move happens (a decode worker drained and gone,
a prefill worker started in its place), every request sent before, during and after it ends
with the tokens of an undisturbed run, and no block stays held anywhere."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from pdserve.cluster.serving.pools import Phase
from pdserve.cluster.sim.step_costs import Curve, StepCosts
from pdserve.engine.sampling import SamplingParams
from tests.cluster.streams import Streamed, collect, pools_are_full, wait_until
from tests.engine.prompts import prompt_ids

# Made-up costs: a prompt of ~60 tokens takes 3 s to prefill, decoding is cheap. One prefill
# worker misses a 2 s TTFT target at any rate the test sends; two come closer by far.
COSTS = StepCosts(Curve.of([(0, 0.05), (100, 5.0)]), Curve.of([(1, 0.002), (64, 0.004)]))


@pytest.fixture(scope="module")
def srv(start, tmp_path_factory):
    profile = tmp_path_factory.mktemp("planner") / "profile.json"
    COSTS.save(profile)
    planner = {"enabled": True, "profile": str(profile), "ttft_target_ms": 2000, "itl_target_ms": 1000,
               "interval_s": 0.5, "window_s": 30, "min_change_interval_s": 600, "hysteresis": 1,
               "min_requests": 2, "sim_requests": 100,
               "correction_intervals": 0}  # the made-up profile is meant to be wrong: no learning it away
    return start(pools={"mode": "disaggregated", "num_prefill": 1, "num_decode": 2, "planner": planner},
                 drain={"check_s": 0.05})


def test_the_planner_moves_a_decode_worker_to_prefill_under_load(srv, engine, tokenizer):
    worker_set = srv.server.worker_set
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [prompt_ids(tokenizer, 50 + 3 * i, variant=80 + i) for i in range(40)]
    want = [out.token_ids for out in engine.generate(prompts, params)]
    decode_ids = {w.worker_id for w in worker_set.decode.workers}
    sent: list[tuple[int, Future[Streamed]]] = []
    during = 0  # requests sent while the move was under way
    done = threading.Event()

    def moving() -> bool:  # a decode worker draining, or gone while its replacement starts
        decode = worker_set.decode.workers
        return any(w.phase is not Phase.SERVING for w in decode) or \
            (len(decode) == 1 and len(worker_set.prefill.serving()) < 2)

    with ThreadPoolExecutor(16) as pool:
        def send_until_moved() -> None:
            nonlocal during
            for i in range(len(prompts)):
                if done.is_set():
                    return
                during += moving()
                sent.append((i, pool.submit(collect, srv.target, prompts[i], params, 120.0)))
                time.sleep(0.25)

        sender = threading.Thread(target=send_until_moved)
        sender.start()
        try:
            wait_until(lambda: len(worker_set.prefill.serving()) == 2, 60, "the planner to add a prefill worker")
        finally:
            done.set()
            sender.join()
        streamed = [(i, f.result(120)) for i, f in sent]
    assert [s.token_ids for _, s in streamed] == [want[i] for i, _ in streamed]
    assert during >= 1, "no request was sent while the worker changed role"
    assert len(worker_set.decode.serving()) == 1 and len(worker_set.decode.workers) == 1
    assert worker_set.decode.gone and worker_set.decode.gone[-1].worker_id in decode_ids
    assert srv.server.metrics.planner_decisions.labels("change")._value.get() == 1  # one change, no flapping
    wait_until(lambda: pools_are_full(srv.target), 30, "every block to be free")
