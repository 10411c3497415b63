"""Liveness over real Ray actors on the CPU: a worker busy in a step far longer than
the ping timeout (and the KV transfer timeout) is kept and its request completes; a
worker killed with SIGKILL is found and replaced."""

from __future__ import annotations

import os
import signal

import pytest

from pdserve.engine.sampling import SamplingParams
from tests.cluster.streams import DEFAULT_MODEL, collect, pools_are_full, wait_until
from tests.engine.prompts import prompt_ids

pytestmark = pytest.mark.slow

PROMPT_TOKENS = 2000  # one prefill step (the default budget is 2,048 tokens): 10-90 s on a 2-core CPU

# Pings every 0.5 s, each bounded by 0.5 s, and silence beyond 8 s counts as death: far
# below the one step that computes the prompt. (Silence bounds of 1 s were seen to trip on
# an overloaded 2-core machine: the OS, not the engine, left the health thread unscheduled.)
HEALTH = {"interval_s": 0.5, "ping_timeout_s": 0.5, "unresponsive_after_s": 8.0}


@pytest.fixture(scope="module")
def server(start):
    # A KV transfer bound far below the prefill, too: the decode worker's wait for the KV,
    # which starts beside the prefill, is kept alive by the prefill worker while it computes.
    # The default model, not the small one: its 30 layers make the one prefill step long.
    return start(pools={"mode": "disaggregated"}, health=HEALTH, kv_transport={"transfer_timeout_s": 8.0},
                 engine=DEFAULT_MODEL)


def _lost(srv) -> float:
    return _count(srv.server.metrics.workers_lost)


def _count(counter) -> float:
    return sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))


def test_a_long_prefill_step_completes_and_no_worker_is_replaced(server, tokenizer):
    worker_set = server.server.worker_set
    before = [list(p.workers) for p in worker_set.pools()]
    out = collect(server.target, prompt_ids(tokenizer, PROMPT_TOKENS), SamplingParams(temperature=0.0, max_tokens=4,
                                                                                       ignore_eos=True), 600)
    assert len(out.token_ids) == 4
    assert [p.num_replaced for p in worker_set.pools()] == [0, 0]
    assert [list(p.workers) for p in worker_set.pools()] == before
    assert all(w.state.healthy for p in worker_set.pools() for w in p.workers)
    assert _lost(server) == 0
    # ...and it ran once: a KV transfer that timed out would have been retried (migrated).
    assert _count(server.server.metrics.migrations) == 0
    wait_until(lambda: pools_are_full(server.target), 10, "every block to be free")


def test_a_sigkilled_worker_is_detected_and_replaced(server):
    import ray

    prefill = server.server.worker_set.prefill
    victim = prefill.workers[0]
    pid = ray.get(victim.actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: prefill.num_replaced == 1 and prefill.workers[0] is not victim
               and prefill.workers[0].state.healthy, 180, "the pool to replace the killed prefill worker")
    assert _lost(server) == 1
    assert collect(server.target, "Hi there", SamplingParams(temperature=0.0, max_tokens=4)).token_ids
