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
from pdserve.cluster.serving.metrics import Metrics
from pdserve.cluster.serving.pools import Phase, Pool, Worker
from pdserve.cluster.serving.router import PromptBlocks, WorkerState
from pdserve.cluster.serving.worker_set import WorkerSet
from pdserve.cluster.settings.config import CoordinatorConfig, RouterConfig
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


def _elastic(num_workers: int) -> tuple[Elastic, WorkerSet]:
    """A worker set of one decode pool (its seats, streams and KV index real), not started."""
    worker_set = WorkerSet(None, _Pool(num_workers), "least_load", 16, Metrics(), 4, 2,
                           CoordinatorConfig(poll_wait_s=0.5), RouterConfig())
    return Elastic(worker_set, DrainConfig(check_s=0.01, stop_timeout_s=5)), worker_set


def test_a_draining_worker_takes_no_seat_and_the_last_serving_one_stays_while_requests_need_it():
    async def run() -> None:
        elastic, worker_set = _elastic(2)
        first, second = worker_set.decode.workers
        worker_set.seats.seat(first, "r1", 1)  # a request runs on the first
        assert (await elastic.drain("decode-0", 60, wait=False)).phase is Phase.DRAINING
        assert worker_set.decode.serving() == [second]
        seated = await worker_set.seats.take("r2", 1, False, False, asyncio.get_running_loop().time() + 5,
                                              PromptBlocks.of([1, 2, 3], 16))
        assert seated is second
        worker_set.seats.free(second, "r2")
        with pytest.raises(AdminRefused, match="last serving decode worker and 1 request"):
            await elastic.drain("decode-1", 60, wait=False)  # r1 may move to it
        assert second.phase is Phase.SERVING
        worker_set.seats.free(first, "r1")
        worker_set.kv_index.apply("decode-0", KVEventBatch("i0", 0, (BlockStored(7, None),)))
        await asyncio.wait_for(elastic.drain("decode-0", None, wait=True), 5)
        assert first.phase is Phase.GONE and worker_set.decode.stopped == ["decode-0"]
        assert worker_set.kv_index.prefix_blocks([7]) == {}  # its cached blocks left the router's index
        assert (await elastic.drain("decode-1", 60, wait=False)).phase is Phase.DRAINING  # nothing needs it now
        await elastic.stop()

    asyncio.run(run())


def test_past_its_deadline_a_drained_workers_streams_end_with_worker_lost_and_it_leaves():
    async def run() -> None:
        elastic, worker_set = _elastic(2)
        victim = worker_set.decode.workers[0]
        worker_set.seats.seat(victim, "r1", 1)
        queue = worker_set.streams.open("r1", victim)
        queue.put_nowait(TokenDelta("r1", (7,)))  # streamed before the deadline: read first
        await elastic.drain("decode-0", 0.0, wait=False)
        assert (await asyncio.wait_for(queue.get(), 5)).token_ids == (7,)
        assert isinstance(await asyncio.wait_for(queue.get(), 5), WorkerLost)
        assert victim.phase is Phase.DRAINING  # until the request lets go of it
        worker_set.streams.close("r1")
        worker_set.seats.free(victim, "r1")  # its abort there, once it continued elsewhere
        await asyncio.wait_for(elastic.drain("decode-0", None, wait=True), 5)
        assert victim.phase is Phase.GONE and not victim.state.healthy
        assert [w.worker_id for w in worker_set.decode.gone] == ["decode-0"]

    asyncio.run(run())


def test_a_lost_worker_is_not_drained():
    async def run() -> None:
        elastic, worker_set = _elastic(2)
        worker_set.decode.workers[0].state.healthy = False
        with pytest.raises(AdminRefused, match="lost"):
            await elastic.drain("decode-0", 60, wait=False)

    asyncio.run(run())
