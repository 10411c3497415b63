"""The line for decode seats (cluster/serving/seats.py), without Ray: a request
waits for a running seat and the free KV blocks to reserve its prompt, in priority order and
first come first served within one; one that would wait behind a full queue is refused without waiting for anything."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.cluster.serving.errors import Overloaded
from pdserve.cluster.serving.kv_index import KVIndex
from pdserve.cluster.serving.pools import Pool, Worker
from pdserve.cluster.serving.router import KVClaim, LeastLoad, PrefixAware, PromptBlocks, WorkerState
from pdserve.cluster.serving.seats import SeatLine
from pdserve.cluster.settings.config import CoordinatorConfig
from pdserve.cluster.settings.tenants import DEFAULT_TENANT, Tenant
from pdserve.engine.kv.events import BlockStored, KVEventBatch
from pdserve.engine.messages import WorkerRequest
from pdserve.engine.outputs import EngineLoad
from pdserve.engine.sampling import SamplingParams

BLOCK = 16


def _load(num_free_blocks: int, num_blocks: int = 10, num_running: int = 0) -> EngineLoad:
    return EngineLoad(num_running=num_running, num_waiting=0, num_receiving=0, num_held=0, queued_prefill_tokens=0,
                      num_free_blocks=num_free_blocks, num_blocks=num_blocks,
                      num_reservable_blocks=num_free_blocks - num_running, prefix_queried_tokens=0,
                      prefix_hit_tokens=0, num_preemptions=0)


def _line(num_blocks: int = 10, seats: int = 4, max_waiting: int = 2, preempt: bool = False) -> SeatLine:
    decode = Pool("decode", 1, None)
    decode.workers = [Worker("decode", None, WorkerState("decode-0", load=_load(num_blocks, num_blocks)), None)]
    return SeatLine(decode, LeastLoad(), BLOCK, seats, max_waiting, CoordinatorConfig(), preempt)


async def _seat(c: SeatLine, rid: str, need: int, front: bool = False, priority: int = 0,
                tenant: Tenant = DEFAULT_TENANT) -> Worker:
    """A seat for `rid` and its claim on `need` blocks, as a disaggregated request takes them."""
    return await c.take(rid, need, front, False, asyncio.get_running_loop().time() + 60, _prompt(need), priority,
                        tenant)


def _prompt(num_blocks: int) -> PromptBlocks:
    return PromptBlocks.of(list(range(num_blocks * BLOCK)), BLOCK)


async def _settle() -> None:
    """Let every task that can run do so (a wake passes through a few tasks' turns)."""
    for _ in range(50):
        await asyncio.sleep(0)


def test_a_request_reserves_its_prompts_blocks():
    req = WorkerRequest("r", tuple(range(33)), SamplingParams(max_tokens=100))
    assert _line().kv_need(len(req.prompt_token_ids)) == 3


def test_of_the_decode_workers_that_fit_the_one_holding_the_prefix_takes_the_request():
    async def scenario() -> None:
        decode = Pool("decode", 2, None)
        decode.workers = [Worker("decode", None, WorkerState(f"decode-{i}", load=_load(10)), None) for i in range(2)]
        index = KVIndex()
        prompt = _prompt(3)
        index.apply("decode-1", KVEventBatch("d1", 0, tuple(
            BlockStored(h, prompt.block_hashes[i - 1] if i else None) for i, h in enumerate(prompt.block_hashes))))
        line = SeatLine(decode, PrefixAware(index), BLOCK, 4, 2, CoordinatorConfig())
        # Both idle: by name decode-0 would take it; decode-1 holds the prompt's blocks.
        assert (await _seat(line, "a", 3)).worker_id == "decode-1"
        other = PromptBlocks.of(list(range(1000, 1000 + 3 * BLOCK)), BLOCK)
        took = await line.take("b", 3, False, False, asyncio.get_running_loop().time() + 60, other)
        assert took.worker_id == "decode-0"  # nothing cached anywhere: the less loaded one

    asyncio.run(scenario())


def test_kv_headroom_is_the_load_less_the_reservations_it_may_not_show():
    state = WorkerState("decode-0", load=_load(10, num_running=1), load_asked_at=5.0)
    state.claims = {"seen": KVClaim(3, reserved_at=4.0), "after": KVClaim(2, reserved_at=6.0), "pending": KVClaim(1)}
    # One block of headroom per running sequence (the engine's), the two unseen claims and theirs.
    assert state.kv_headroom() == 10 - 1 - (2 + 1) - (1 + 1)
    assert WorkerState("decode-1").kv_headroom() is None


def test_a_request_the_kv_left_cannot_hold_waits_and_only_one_beyond_the_queue_is_refused():
    async def scenario() -> None:
        c = _line(num_blocks=10, seats=4, max_waiting=2)
        worker = await _seat(c, "a", 6)  # seats are still free, but only 10 - (6 + 1) blocks
        big = asyncio.create_task(_seat(c, "b", 6))
        small = asyncio.create_task(_seat(c, "c", 2))  # it would fit, but waits its turn behind `big`
        await _settle()
        assert not big.done() and not small.done() and c.num_queued == 2

        # The queue (2 per decode worker) is full: refused before its coroutine waits once.
        coro = c.take("d", 1, False, False, asyncio.get_running_loop().time() + 60, _prompt(1))
        with pytest.raises(Overloaded, match="2 requests are queued"):
            coro.send(None)
        assert c.num_queued == 2 and not big.done() and not small.done()

        c.free(worker, "a")
        await _settle()
        assert big.done() and small.done()  # both fit now, (6 + 1) + (2 + 1) of 10, in their order
        assert set(worker.state.claims) == {"b", "c"} and worker.state.inflight == 2 and c.num_queued == 0

    asyncio.run(scenario())


def test_a_waiting_request_takes_the_blocks_a_new_load_shows_free():
    async def scenario() -> None:
        c = _line(num_blocks=10)
        worker = await _seat(c, "a", 6)
        worker.state.claims["a"].reserved_at = 1.0
        worker.state.load, worker.state.load_asked_at = _load(2, num_running=1), 2.0  # "a" shows in it
        waiting = asyncio.create_task(_seat(c, "b", 4))
        await _settle()
        assert not waiting.done()
        c.free(worker, "a")  # its blocks are freed on the worker; the load does not show it yet
        await _settle()
        assert not waiting.done()
        worker.state.load, worker.state.load_asked_at = _load(10), 3.0
        c.wake()  # what the load loop does after each read
        await _settle()
        assert waiting.done()

    asyncio.run(scenario())


def test_seats_bound_the_batch_and_a_retried_request_goes_first():
    async def scenario() -> None:
        c = _line(num_blocks=100, seats=1, max_waiting=1)
        worker = await _seat(c, "a", 2)
        waiting = asyncio.create_task(_seat(c, "b", 2))
        await _settle()
        assert not waiting.done()
        retried = asyncio.create_task(_seat(c, "c", 2, front=True))  # never refused, and ahead of the queue
        await _settle()
        assert not retried.done() and c.num_queued == 2
        c.free(worker, "a")
        await _settle()
        assert retried.done() and not waiting.done()
        waiting.cancel()
        await _settle()
        assert c.num_queued == 0

    asyncio.run(scenario())


def test_requests_wait_in_priority_order_then_arrival():
    async def scenario() -> None:
        c = _line(num_blocks=100, seats=1, max_waiting=4)
        worker = await _seat(c, "a", 2)
        order: list[str] = []

        async def seat(rid: str, priority: int, front: bool = False) -> None:
            await _seat(c, rid, 2, front, priority)
            order.append(rid)

        tasks = []
        for rid, priority, front in (("batch", 5, False), ("chat", -1, False), ("normal", 0, False),
                                     ("chat2", -1, False), ("retried-batch", 5, True)):
            tasks.append(asyncio.create_task(seat(rid, priority, front)))
            await _settle()
        for _ in tasks:
            c.free(worker, order[-1] if order else "a")
            await _settle()
        assert order == ["chat", "chat2", "normal", "retried-batch", "batch"]
        full = _line(num_blocks=100, seats=1, max_waiting=1)
        worker = await _seat(full, "running", 2)
        low = asyncio.create_task(_seat(full, "low", 2, priority=1))
        await _settle()
        with pytest.raises(Overloaded):  # one is ahead of it: the queue is full
            await _seat(full, "same", 2, priority=1)
        high = asyncio.create_task(_seat(full, "high", 2, priority=0))  # nobody ahead of it: it waits
        await _settle()
        assert not high.done() and full.num_queued == 2
        full.free(worker, "running")
        await _settle()
        assert high.done() and not low.done()
        low.cancel()
        await _settle()

    asyncio.run(scenario())


def test_where_engines_preempt_a_higher_priority_request_takes_a_lower_ones_seat():
    """With the decode engines' priority policy a seat held by a request of lower priority is
    free to one of higher priority (the engine preempts the other, `Scheduler.can_seat`): no
    more than `seats` of a priority or higher, fewer beyond the seats than the queue holds."""
    async def scenario() -> None:
        c = _line(num_blocks=100, seats=2, max_waiting=2, preempt=True)
        worker = await _seat(c, "low0", 2, priority=1)
        await _seat(c, "low1", 2, priority=1)
        same = asyncio.create_task(_seat(c, "same", 2, priority=1))
        await _settle()
        assert not same.done(), "a seat held at its own priority is not free to it"
        same.cancel()
        await _settle()
        assert await _seat(c, "high", 2, priority=0) is worker and worker.state.inflight == 3
        high2 = asyncio.create_task(_seat(c, "high2", 2, priority=-1))
        await _settle()
        assert not high2.done(), "beyond max_waiting - 1 over the seats, it waits"
        c.free(worker, "low0")
        await _settle()
        assert high2.done() and worker.state.inflight == 3
        one = _line(num_blocks=100, seats=1, max_waiting=1, preempt=True)  # a queue of one still preempts
        worker = await _seat(one, "low", 2, priority=1)
        assert await asyncio.wait_for(_seat(one, "high", 2, priority=-1), 30) is worker and worker.state.inflight == 2
        fcfs = _line(num_blocks=100, seats=1, max_waiting=1)
        await _seat(fcfs, "low", 2, priority=1)
        high = asyncio.create_task(_seat(fcfs, "high", 2, priority=-1))
        await _settle()
        assert not high.done(), "engines that do not preempt: a seat is free only once its request ends"
        high.cancel()
        await _settle()

    asyncio.run(scenario())


def test_a_tenant_under_its_share_is_not_refused_for_anothers_queue():
    """The line's bound counts those that go first (`_head`'s rule), not those that came first:
    with a's requests filling the queue, b's (no seat held) would go before them and is taken."""
    async def scenario() -> None:
        a, b = Tenant("a"), Tenant("b")
        c = _line(num_blocks=100, seats=2, max_waiting=2)
        worker = await _seat(c, "a0", 2, tenant=a)
        await _seat(c, "a1", 2, tenant=a)
        queued = [asyncio.create_task(_seat(c, f"a{i}", 2, tenant=a)) for i in (2, 3)]
        await _settle()
        with pytest.raises(Overloaded):
            await _seat(c, "a4", 2, tenant=a)
        b0 = asyncio.create_task(_seat(c, "b0", 2, tenant=b))
        await _settle()
        assert not b0.done() and c.num_queued == 3
        c.free(worker, "a0")
        await _settle()
        assert b0.done() and not any(q.done() for q in queued)
        for q in queued:
            q.cancel()
        await _settle()

    asyncio.run(scenario())


def test_of_tenants_holding_as_many_seats_the_one_given_fewer_goes_first():
    """One seat; a was given two while it stayed backlogged, b none: when the seat frees (each
    tenant then holds none) b's request takes it, though a's waited longer (else every tie goes
    to the tenant that floods, whose requests are always the oldest)."""
    async def scenario() -> None:
        a, b = Tenant("a"), Tenant("b")
        c = _line(num_blocks=100, seats=1, max_waiting=8)
        worker = await _seat(c, "a0", 2, tenant=a)
        a1 = asyncio.create_task(_seat(c, "a1", 2, tenant=a))
        await _settle()
        c.free(worker, "a0")
        await _settle()
        assert a1.done()  # a was given 2 seats, and stays backlogged:
        a2 = asyncio.create_task(_seat(c, "a2", 2, tenant=a))
        await _settle()
        b0 = asyncio.create_task(_seat(c, "b0", 2, tenant=b))
        await _settle()
        c.free(worker, "a1")
        await _settle()
        assert b0.done() and not a2.done()
        c.free(worker, "b0")
        await _settle()
        assert a2.done()

    asyncio.run(scenario())


def test_where_engines_preempt_a_tenant_under_its_share_takes_a_seat_of_one_over_it():
    """The engines' rule (`Scheduler.can_seat`, `tenant_share.under_share`) in the seat line: a
    holds both seats at b's priority; b's request is seated over them (the engine preempts one
    of a's), b's second is not (1 + 1 is not fewer than a's 2); without preemption b waits."""
    async def scenario() -> None:
        a, b = Tenant("a"), Tenant("b")
        c = _line(num_blocks=100, seats=2, max_waiting=3, preempt=True)
        worker = await _seat(c, "a0", 2, tenant=a)
        await _seat(c, "a1", 2, tenant=a)
        assert await asyncio.wait_for(_seat(c, "b0", 2, tenant=b), 30) is worker and worker.state.inflight == 3
        b1 = asyncio.create_task(_seat(c, "b1", 2, tenant=b))
        fcfs = _line(num_blocks=100, seats=1, max_waiting=3)
        await _seat(fcfs, "a0", 2, tenant=a)
        b_fcfs = asyncio.create_task(_seat(fcfs, "b0", 2, tenant=b))
        await _settle()
        assert not b1.done() and not b_fcfs.done()
        for t in (b1, b_fcfs):
            t.cancel()
        await _settle()

    asyncio.run(scenario())


def test_of_one_priority_the_tenant_with_the_fewest_seats_for_its_weight_goes_first():
    async def scenario() -> None:
        a, b, heavy = Tenant("a"), Tenant("b"), Tenant("heavy", weight=4.0)
        c = _line(num_blocks=100, seats=2, max_waiting=8)
        worker = await _seat(c, "a0", 2, tenant=a)
        await _seat(c, "a1", 2, tenant=a)
        order: list[str] = []

        async def seat(rid: str, tenant: Tenant, priority: int = 0, front: bool = False) -> None:
            await _seat(c, rid, 2, front, priority, tenant)
            order.append(rid)

        for rid, tenant, priority in (("a2", a, 0), ("a3", a, 0), ("b0", b, 0), ("b-low", b, 1)):
            asyncio.create_task(seat(rid, tenant, priority))
            await _settle()
        c.free(worker, "a0")  # a holds 1 seat, b none: b's goes before a's earlier ones
        await _settle()
        assert order == ["b0"]
        c.free(worker, "a1")  # a 0, b 1: a's first
        await _settle()
        assert order == ["b0", "a2"]
        retried = asyncio.create_task(seat("a-retried", a, front=True))
        await _settle()
        c.free(worker, "a2")  # a retried request keeps its place at the front, whoever's it is
        await _settle()
        assert order == ["b0", "a2", "a-retried"]
        assert retried.done()
        asyncio.create_task(seat("heavy0", heavy))
        await _settle()
        c.free(worker, "b0")  # a 1 seat for weight 1, heavy 0: heavy, though a's waited longer
        await _settle()
        assert order[-1] == "heavy0"
        c.free(worker, "heavy0")
        c.free(worker, "a-retried")
        await _settle()
        assert order[-2:] == ["a3", "b-low"], "a lower priority goes last, whatever its tenant's share"
        assert c.num_queued == 0

    asyncio.run(scenario())


def test_a_new_request_waits_for_the_only_decode_workers_replacement():
    """No healthy decode worker, one being replaced: a new request queues for the replacement
    (the queue counts the workers under replacement), not refused as if the server were full."""
    async def scenario() -> None:
        c = _line(num_blocks=10, max_waiting=2)
        lost = c.decode.workers[0]
        lost.state.healthy = False
        c.decode.replacing = 1
        waiting = asyncio.create_task(_seat(c, "a", 2))
        await _settle()
        assert not waiting.done() and c.num_queued == 1
        replacement = Worker("decode", None, WorkerState("decode-1", load=_load(10)), None)
        c.decode.workers, c.decode.replacing = [replacement], 0
        c.wake()
        await _settle()
        assert waiting.result() is replacement

    asyncio.run(scenario())
