"""A drain's rules (cluster/scaling/elastic.py) without Ray, over pools whose actors are stand-ins:
the last serving worker of a role stays while any request of its pool may need it (a draining
worker's requests move to a serving one past its deadline); a draining worker takes no seat; past
the deadline its streams end with WorkerLost behind the deltas already queued, and it leaves once
they have let go of it; a lost worker is not drained."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.cluster.scaling.elastic import AdminRefused, Elastic
from pdserve.cluster.serving.errors import WorkerLost
from pdserve.cluster.serving.kv_index import KVIndex
from pdserve.cluster.serving.metrics import Metrics
from pdserve.cluster.serving.pools import Phase, Pool, Worker
from pdserve.cluster.serving.router import LeastLoad, PromptBlocks, WorkerState
from pdserve.cluster.serving.seats import SeatLine
from pdserve.cluster.serving.token_streams import TokenStreams
from pdserve.cluster.settings.config import CoordinatorConfig
from pdserve.cluster.settings.pool_config import DrainConfig
from pdserve.engine.kv.events import BlockStored, KVEventBatch
from pdserve.engine.outputs import TokenDelta


class _Pool(Pool):
    """A pool whose actors are stand-ins: stopping one records it."""

    def __init__(self, num_workers: int) -> None:
        super().__init__("decode", num_workers, None)  # type: ignore[arg-type]
        self.workers = [Worker("decode", None, WorkerState(f"decode-{i}"), None) for i in range(num_workers)]
        self.stopped: list[str] = []

    async def _stop_actor(self, worker: Worker) -> None:
        self.stopped.append(worker.worker_id)


class _Coordinator:
    """The parts of `Coordinator` a drain uses."""

    mode = "disaggregated"

    def __init__(self, decode: _Pool) -> None:
        self.decode = decode
        self.seats = SeatLine(decode, LeastLoad(), 16, 4, 2, CoordinatorConfig())
        self.streams = TokenStreams(decode, 0.5)
        self.kv_index = KVIndex()

    def pools(self) -> list[Pool]:
        return [self.decode]


def _elastic(num_workers: int) -> tuple[Elastic, _Coordinator]:
    coordinator = _Coordinator(_Pool(num_workers))
    return Elastic(coordinator, DrainConfig(check_s=0.01, stop_timeout_s=5), Metrics()), coordinator  # type: ignore[arg-type]


def test_a_draining_worker_takes_no_seat_and_the_last_serving_one_stays_while_requests_need_it():
    async def run() -> None:
        elastic, coordinator = _elastic(2)
        first, second = coordinator.decode.workers
        coordinator.seats.seat(first, "r1", 1)  # a request runs on the first
        assert (await elastic.drain("decode-0", 60, wait=False)).phase is Phase.DRAINING
        assert coordinator.decode.serving() == [second]
        seated = await coordinator.seats.take("r2", 1, False, False, asyncio.get_running_loop().time() + 5,
                                              PromptBlocks.of([1, 2, 3], 16))
        assert seated is second
        coordinator.seats.free(second, "r2")
        with pytest.raises(AdminRefused, match="last serving decode worker and 1 request"):
            await elastic.drain("decode-1", 60, wait=False)  # r1 may move to it
        assert second.phase is Phase.SERVING
        coordinator.seats.free(first, "r1")
        coordinator.kv_index.apply("decode-0", KVEventBatch("i0", 0, (BlockStored(7, None),)))
        await asyncio.wait_for(elastic.drain("decode-0", None, wait=True), 5)
        assert first.phase is Phase.GONE and coordinator.decode.stopped == ["decode-0"]
        assert coordinator.kv_index.prefix_blocks([7]) == {}  # its cached blocks left the router's index
        assert (await elastic.drain("decode-1", 60, wait=False)).phase is Phase.DRAINING  # nothing needs it now
        await elastic.stop()

    asyncio.run(run())


def test_past_its_deadline_a_drained_workers_streams_end_with_worker_lost_and_it_leaves():
    async def run() -> None:
        elastic, coordinator = _elastic(2)
        victim = coordinator.decode.workers[0]
        coordinator.seats.seat(victim, "r1", 1)
        queue = coordinator.streams.open("r1", victim)
        queue.put_nowait(TokenDelta("r1", (7,)))  # streamed before the deadline: read first
        await elastic.drain("decode-0", 0.0, wait=False)
        assert (await asyncio.wait_for(queue.get(), 5)).token_ids == (7,)
        assert isinstance(await asyncio.wait_for(queue.get(), 5), WorkerLost)
        assert victim.phase is Phase.DRAINING  # until the request lets go of it
        coordinator.streams.close("r1")
        coordinator.seats.free(victim, "r1")  # its abort there, once it continued elsewhere
        await asyncio.wait_for(elastic.drain("decode-0", None, wait=True), 5)
        assert victim.phase is Phase.GONE and not victim.state.healthy
        assert [w.worker_id for w in coordinator.decode.gone] == ["decode-0"]

    asyncio.run(run())


def test_a_lost_worker_is_not_drained():
    async def run() -> None:
        elastic, coordinator = _elastic(2)
        coordinator.decode.workers[0].state.healthy = False
        with pytest.raises(AdminRefused, match="lost"):
            await elastic.drain("decode-0", 60, wait=False)

    asyncio.run(run())
