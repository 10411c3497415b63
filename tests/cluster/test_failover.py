"""Lost workers, over real Ray actors, real UCX (TCP/shm) and real gRPC, on the CPU: a
stream whose decode worker is SIGKILLed continues on its replacement with the undisturbed
run's tokens, a decode worker killed while KV is sent to it is fenced and the request
migrates, a new request waits for the only decode worker's replacement, a request whose
prefill worker dies mid-prefill is retried, and a colocated stream whose worker dies
continues; every block is freed. They share each xdist worker's servers of the small
model with test_serving.py (tests/cluster/conftest.py), but for the two kills that must land
while a prompt is prefilled, which run on a server of the default model.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import threading

import pytest

from pdserve.cluster.clients.grpc_client import Client
from pdserve.engine.sampling import SamplingParams
from pdserve.proto.v1 import generation_pb2 as pb
from tests.cluster.streams import DEFAULT_MODEL, collect, pools_are_full, scrape, wait_until
from tests.engine.prompts import prompt_ids

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def disaggregated(disaggregated_server):
    return disaggregated_server


@pytest.fixture(scope="module")
def long_prefills(start):
    """A disaggregated server on the default model, for the tests that SIGKILL a worker while
    a prompt is prefilled: its 30 layers make a 1,500-token prefill seconds long, a window
    the kill lands in (the small model's takes ~0.2 s)."""
    return start(pools={"mode": "disaggregated"}, engine=DEFAULT_MODEL)


def test_a_stream_whose_decode_worker_is_sigkilled_continues_on_its_replacement(disaggregated, engine, tokenizer):
    """The decode worker's process is SIGKILLed mid-stream: the request continues (prompt
    plus the tokens streamed so far prefilled again) on the lost worker's replacement, the
    only decode worker there is; the client's stream has exactly the undisturbed run's tokens.
    The prefill worker still caches the prompt's full blocks: the re-prefill finds them
    (they are sent again, not recomputed)."""
    import ray

    worker_set = disaggregated.server.worker_set
    prompt, params = prompt_ids(tokenizer, 100, variant=19), SamplingParams(temperature=0.0, max_tokens=200,
                                                                            ignore_eos=True)
    want = engine.generate([prompt], params)[0].token_ids
    victim, prefill = worker_set.decode.workers[0], worker_set.prefill.workers[0]
    pid = ray.get(victim.actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
    # Sent once before, so the stream's own prefill takes the prompt's full blocks from cache.
    cached = collect(disaggregated.target, prompt, dataclasses.replace(params, max_tokens=1)).num_cached_tokens
    before = _migrations(disaggregated)
    got: list[int] = []
    with Client(disaggregated.target) as client:
        for resp in client.generate(prompt, params, timeout_s=300):
            got.extend(resp.token_ids)
            if len(got) >= 4 and victim.state.healthy and pid:
                hits = _prefix_hit_tokens(prefill)  # the first prefill is done
                os.kill(pid, signal.SIGKILL)
                pid = 0
            finish = resp.finish_reason
    assert got == want and finish == pb.FINISH_REASON_LENGTH
    # The usage counts the request's prefill, not the continuation's re-prefill after the loss.
    assert cached == 0 and resp.usage.cached_prompt_tokens == 16 * (len(prompt) // 16)
    # /metrics lists the live workers' load only: the lost one's series are gone.
    live = {w.worker_id for pool in worker_set.pools() for w in pool.workers}
    wait_until(lambda: _kv_usage_workers(disaggregated) == live, 30, "/metrics to list the live workers only")
    assert _migrations(disaggregated) == before + 1
    assert worker_set.decode.workers[0] is not victim and worker_set.decode.workers[0].state.healthy
    assert _prefix_hit_tokens(prefill) - hits == 16 * (len(prompt) // 16)  # every full block of the prompt
    wait_until(lambda: pools_are_full(disaggregated.target), 30, "every block to be free")


def _kv_usage_workers(srv) -> set[str]:
    """The workers /metrics gives a KV usage for."""
    found = scrape(srv.config.server.metrics_port)
    return {m.group(1) for k in found if (m := re.match(r'pdserve_kv_block_usage_ratio\{.*worker="([^"]+)"', k))}


def _prefix_hit_tokens(worker) -> int:
    """Prompt tokens `worker`'s engine has found in its prefix cache so far."""
    import ray

    return ray.get(worker.actor.load.remote(), timeout=60).prefix_hit_tokens


def test_a_decode_worker_killed_while_kv_is_sent_to_it_is_fenced_and_the_request_migrates(
        long_prefills, default_engine, tokenizer):
    """The decode worker has reserved a long prompt's blocks and the prefill worker, which
    computes it, has addressed its KV to that worker's incarnation, when the decode
    worker's process is SIGKILLed. The transfer to the dead incarnation fails and is not
    reported; the request migrates to the replacement (a new incarnation) and streams the
    undisturbed run's tokens, its re-prefill served from the prefill worker's prefix cache.
    The prefill worker is not wedged (not replaced, the next request runs) and every block
    on every worker is free afterwards."""
    import ray

    worker_set = long_prefills.server.worker_set
    prompt = prompt_ids(tokenizer, 1500, variant=23)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = default_engine.generate([prompt], params)[0].token_ids
    victim, prefill = worker_set.decode.workers[0], worker_set.prefill.workers[0]
    pid = ray.get(victim.actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
    before, hits = _migrations(long_prefills), _prefix_hit_tokens(prefill)
    responses: list = []

    def run() -> None:
        with Client(long_prefills.target) as client:
            responses.extend(client.generate(prompt, params, timeout_s=600))

    waiter = threading.Thread(target=run)
    waiter.start()
    wait_until(lambda: prefill.state.inflight == 1
               and ray.get(victim.actor.load.remote(), timeout=30).num_receiving == 1, 60,
               "the decode worker to expect the KV that the prefill worker computes")
    os.kill(pid, signal.SIGKILL)
    waiter.join(600)
    assert not waiter.is_alive(), "the request hung"
    assert [t for r in responses for t in r.token_ids] == want
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert len(responses[-1].kv_transfers) == 1  # to the replacement only
    fresh = worker_set.decode.workers[0]
    assert fresh is not victim and fresh.state.healthy
    assert fresh.address.incarnation and fresh.address.incarnation != victim.address.incarnation
    assert _migrations(long_prefills) == before + 1
    assert _prefix_hit_tokens(prefill) - hits >= 16 * ((len(prompt) - 1) // 16)
    assert worker_set.prefill.workers[0] is prefill and prefill.state.healthy and prefill.state.inflight == 0
    short = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    assert collect(long_prefills.target, "Name three colours.", short).token_ids == \
        default_engine.generate(["Name three colours."], short)[0].token_ids
    wait_until(lambda: pools_are_full(long_prefills.target), 30, "every block to be free")


def test_a_new_request_waits_for_the_only_decode_workers_replacement(disaggregated, engine):
    """The only decode worker is SIGKILLed and found lost: a request that arrives while its
    replacement starts waits for it (it is not refused UNAVAILABLE) and gets the engine's tokens."""
    import ray

    worker_set = disaggregated.server.worker_set
    prompt, params = "Name three colours.", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = engine.generate([prompt], params)[0].token_ids
    victim = worker_set.decode.workers[0]
    os.kill(ray.get(victim.actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30), signal.SIGKILL)
    wait_until(lambda: worker_set.decode.replacing == 1, 30, "the pool to begin replacing its lost worker")
    got = collect(disaggregated.target, prompt, params, 300)
    assert got.token_ids == want
    assert worker_set.decode.workers[0] is not victim and worker_set.decode.replacing == 0
    wait_until(lambda: pools_are_full(disaggregated.target), 30, "every block to be free")


def test_a_request_whose_prefill_worker_is_sigkilled_mid_prefill_is_retried(long_prefills, default_engine, tokenizer):
    """The prefill worker dies while it computes the prompt: the request is prefilled again
    on the replacement and the client's stream is the undisturbed run's."""
    import ray

    worker_set = long_prefills.server.worker_set
    prompt = prompt_ids(tokenizer, 1500, variant=7)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    want = default_engine.generate([prompt], params)[0].token_ids
    victim = worker_set.prefill.workers[0]
    pid = ray.get(victim.actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
    before = _migrations(long_prefills)
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(collect(long_prefills.target, prompt, params, 300)))
    waiter.start()
    wait_until(lambda: victim.state.inflight == 1, 30, "the prefill to start")
    os.kill(pid, signal.SIGKILL)
    waiter.join(300)
    assert got and got[0].token_ids == want
    assert _migrations(long_prefills) == before + 1
    assert worker_set.prefill.workers[0] is not victim
    wait_until(lambda: pools_are_full(long_prefills.target), 30, "every block to be free")


def test_a_colocated_stream_whose_worker_is_sigkilled_continues(colocated_server, engine):
    import ray

    srv = colocated_server
    worker_set = srv.server.worker_set
    prompt, params = "Tell me a very long story.", SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    want = engine.generate([prompt], params)[0].token_ids
    victim = worker_set.decode.workers[0]
    pid = ray.get(victim.actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
    before = _migrations(srv)
    got: list[int] = []
    with Client(srv.target) as client:
        for resp in client.generate(prompt, params, timeout_s=300):
            got.extend(resp.token_ids)
            if len(got) >= 4 and pid:
                os.kill(pid, signal.SIGKILL)
                pid = 0
    assert got == want and _migrations(srv) == before + 1
    wait_until(lambda: pools_are_full(srv.target), 30, "every block to be free")


def _migrations(srv) -> float:
    return sum(s.value for m in srv.server.metrics.migrations.collect() for s in m.samples
               if s.name.endswith("_total"))
