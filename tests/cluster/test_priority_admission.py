"""The frontend's admission by priority (cluster/api/admission.py), without Ray: on a full
server a higher-priority arrival takes the place of the lowest-priority queued request (the
latest among equals), which is refused with RESOURCE_EXHAUSTED and its retry hint and aborted
in the pools; an arrival that outranks nobody queued is refused itself; a request that has
its first token is never displaced."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from pdserve.cluster.api.frontend import Frontend, RequestFailed, Status
from pdserve.cluster.serving.metrics import Metrics
from pdserve.engine.messages import WorkerRequest
from pdserve.engine.outputs import TokenDelta
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.sequence import FinishReason
from pdserve.engine.text.request_processor import RequestProcessor


class FakeCoordinator:
    """Capacity `capacity`; each request waits until the test starts it (its first token),
    then until the test finishes it; one closed early is counted as aborted."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self.go: dict[int, asyncio.Event] = {}  # by the request's priority: tests give each its own
        self.done: dict[int, asyncio.Event] = {}
        self.aborted: list[int] = []

    def capacity(self) -> int:
        return self._capacity

    async def generate(self, req: WorkerRequest, report: object = None) -> AsyncIterator[TokenDelta]:
        p = req.params.priority
        self.go[p], self.done[p] = asyncio.Event(), asyncio.Event()
        finished = False
        try:
            await self.go[p].wait()
            yield TokenDelta(req.request_id, (1,))
            await self.done[p].wait()
            finished = True
            yield TokenDelta(req.request_id, (2,), FinishReason.LENGTH)
        finally:
            if not finished:
                self.aborted.append(p)


def frontend(capacity: int) -> Frontend:
    processor = RequestProcessor(None, "fake", 100, 64)
    return Frontend(FakeCoordinator(capacity), processor, Metrics(), 60.0, 2.0)  # type: ignore[arg-type]


async def run(front: Frontend, priority: int) -> list[int] | RequestFailed:
    request = front.processor.process([1, 2, 3], params=SamplingParams(max_tokens=2, priority=priority))
    try:
        return [t for d in [d async for d in front.generate(request)] for t in d.token_ids]
    except RequestFailed as e:
        return e


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def test_a_higher_priority_arrival_takes_the_lowest_priority_queued_ones_place():
    async def scenario() -> None:
        front = frontend(capacity=3)
        coord = front.coordinator
        tasks = {p: asyncio.create_task(run(front, p)) for p in (5, 7, 6)}  # all queued
        await settle()
        arrival = asyncio.create_task(run(front, 1))
        await settle()
        lowest = await tasks[7]
        assert isinstance(lowest, RequestFailed) and lowest.status is Status.RESOURCE_EXHAUSTED
        assert lowest.retry_after_s == 2.0 and "higher priority" in str(lowest)
        assert coord.aborted == [7] and front.inflight == 3
        # Full again: an arrival that outranks nobody queued is refused itself, as without priorities.
        refused = await run(front, 6)
        assert isinstance(refused, RequestFailed) and refused.status is Status.RESOURCE_EXHAUSTED
        assert coord.aborted == [7]
        # A request with its first token is running: not displaced.
        for p in (1, 5, 6):
            coord.go[p].set()
        await settle()
        assert isinstance(await run(front, 0), RequestFailed)
        for p in (1, 5, 6):
            coord.done[p].set()
        assert [await t for t in (arrival, tasks[5], tasks[6])] == [[1, 2]] * 3
        assert front.inflight == 0
        assert front.metrics.requests.labels("RESOURCE_EXHAUSTED")._value.get() == 3

    asyncio.run(scenario())


@pytest.mark.parametrize("queued, displaced", [((3, 3, 3), 2), ((5, 3, 4), 0), ((4, 3, 4), 2)])
def test_the_latest_of_the_lowest_priority_goes_first(queued, displaced):
    async def scenario() -> None:
        front = frontend(capacity=3)
        order = []
        for i, p in enumerate(queued):  # distinct keys for the fake: priority * 10 + arrival
            order.append(asyncio.create_task(run(front, p * 10 + i)))
            await settle()
        arrival = asyncio.create_task(run(front, 0))
        await settle()
        assert front.coordinator.aborted == [queued[displaced] * 10 + displaced]
        for key in list(front.coordinator.go):
            front.coordinator.go[key].set()
            front.coordinator.done[key].set()
        await asyncio.gather(arrival, *order)

    asyncio.run(scenario())
