"""The coordinator's queue for decode seats (cluster/coordinator.py), without Ray: a request
waits for a running seat and the KV blocks of its prompt + max_tokens, first come first
served; one that would wait behind a full queue is refused without waiting for anything."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.cluster.coordinator import Coordinator, Overloaded
from pdserve.cluster.metrics import Metrics
from pdserve.cluster.pools import Pool, Worker
from pdserve.cluster.router import RoundRobin, WorkerState
from pdserve.engine.messages import WorkerRequest
from pdserve.engine.outputs import EngineLoad
from pdserve.engine.sampling import SamplingParams

BLOCK = 16


def _load(num_blocks: int) -> EngineLoad:
    return EngineLoad(num_running=0, num_waiting=0, num_receiving=0, num_held=0, queued_prefill_tokens=0,
                      num_free_blocks=num_blocks, num_blocks=num_blocks, prefix_queried_tokens=0,
                      prefix_hit_tokens=0, num_preemptions=0)


def _coordinator(num_blocks: int = 10, seats: int = 4, max_waiting: int = 2) -> Coordinator:
    prefill, decode = Pool("prefill", 1, None), Pool("decode", 1, None)
    prefill.workers = [Worker("prefill", None, WorkerState("prefill-0"), None)]
    decode.workers = [Worker("decode", None, WorkerState("decode-0", load=_load(num_blocks)), None)]
    return Coordinator(prefill, decode, RoundRobin(), BLOCK, Metrics(), seats, max_waiting)


async def _seat(c: Coordinator, need: int, front: bool = False) -> tuple[Worker, int]:
    """What `_run` does with a seat: take it and its claim."""
    worker, claim = await c._take_seat(need, front, False, asyncio.get_running_loop().time() + 60)
    worker.state.inflight += 1
    worker.state.num_claimed_blocks += claim
    return worker, claim


async def _settle() -> None:
    """Let every task that can run do so (a wake passes through a few tasks' turns)."""
    for _ in range(50):
        await asyncio.sleep(0)


def test_a_request_needs_blocks_for_its_prompt_and_every_token_it_may_generate():
    c = _coordinator()
    req = WorkerRequest("r", tuple(range(20)), SamplingParams(max_tokens=13))
    assert c._kv_need(req) == 3 + 1  # 33 tokens in blocks of 16, and one block of headroom


def test_a_request_the_kv_left_cannot_hold_waits_and_only_one_beyond_the_queue_is_refused():
    async def scenario() -> None:
        c = _coordinator(num_blocks=10, seats=4, max_waiting=2)
        worker, claim = await _seat(c, 6)  # a seat is still free, but only 4 of the 10 blocks
        big = asyncio.create_task(_seat(c, 6))
        small = asyncio.create_task(_seat(c, 2))  # it would fit, but waits its turn behind `big`
        await _settle()
        assert not big.done() and not small.done() and c.num_queued == 2

        # The queue (2 per decode worker) is full: refused before its coroutine waits once.
        coro = c._take_seat(1, False, False, asyncio.get_running_loop().time() + 60)
        with pytest.raises(Overloaded, match="2 requests are queued"):
            coro.send(None)
        assert c.num_queued == 2 and not big.done() and not small.done()

        c._free_seat(worker, claim)
        await _settle()
        assert big.done() and small.done()  # both fit now (6 + 2 of 10), in their order
        assert worker.state.num_claimed_blocks == 8 and worker.state.inflight == 2 and c.num_queued == 0

    asyncio.run(scenario())


def test_seats_bound_the_batch_and_a_retried_request_goes_first():
    async def scenario() -> None:
        c = _coordinator(num_blocks=100, seats=1, max_waiting=1)
        worker, claim = await _seat(c, 2)
        waiting = asyncio.create_task(_seat(c, 2))
        await _settle()
        assert not waiting.done()
        retried = asyncio.create_task(_seat(c, 2, front=True))  # never refused, and ahead of the queue
        await _settle()
        assert not retried.done() and c.num_queued == 2
        c._free_seat(worker, claim)
        await _settle()
        assert retried.done() and not waiting.done()
        waiting.cancel()
        await _settle()
        assert c.num_queued == 0

    asyncio.run(scenario())


def test_a_request_larger_than_the_pool_claims_it_whole_and_runs_alone():
    async def scenario() -> None:
        c = _coordinator(num_blocks=10, seats=4)
        worker, claim = await _seat(c, 50)
        assert claim == 10
        other = asyncio.create_task(_seat(c, 1))
        await _settle()
        assert not other.done()
        c._free_seat(worker, claim)
        await _settle()
        assert other.done()

    asyncio.run(scenario())
