"""The worker set's one leaving path (cluster/serving/worker_set.py), without Ray, over a pool
whose actors are stand-ins: a worker found lost and one drained and stopped leave alike (their
cached blocks out of the KV index, their open streams ended with WorkerLost, their load series
off /metrics), and only the lost one is counted lost."""

from __future__ import annotations

import asyncio

from pdserve.cluster.serving.errors import WorkerLost
from pdserve.cluster.serving.metrics import Metrics
from pdserve.cluster.serving.pools import Phase, Pool, Worker
from pdserve.cluster.serving.router import WorkerState
from pdserve.cluster.serving.worker_set import WorkerSet
from pdserve.engine.kv.events import BlockStored, KVEventBatch
from pdserve.engine.outputs import EngineLoad


class _Pool(Pool):
    """A decode pool whose actors are stand-ins: stopping one records it."""

    def __init__(self, num_workers: int) -> None:
        super().__init__("decode", num_workers, None)  # type: ignore[arg-type]
        self.workers = [Worker("decode", None, WorkerState(f"decode-{i}"), None) for i in range(num_workers)]
        self.stopped: list[str] = []

    async def _stop_actor(self, worker: Worker) -> None:
        self.stopped.append(worker.worker_id)


def test_a_lost_worker_and_a_drained_one_leave_by_one_path():
    async def run() -> None:
        metrics = Metrics()
        worker_set = WorkerSet(None, _Pool(2), "least_load", 16, metrics, 4, 2)
        lost, drained = worker_set.decode.workers
        queues = {}
        for i, w in enumerate((lost, drained)):
            assert worker_set.kv_index.apply(w.worker_id, KVEventBatch(f"i{i}", 0, (BlockStored(10 + i, None),)))
            metrics.worker_load("decode", w.worker_id, EngineLoad(1, 0, 0, 0, 0, 90, 100, 10, 0, 0, 0))
            queues[w.worker_id] = worker_set.streams.open(f"r{i}", w)

        lost.state.healthy = False
        await worker_set.decode.on_lost(lost)  # as `Pool.replace` tells it, before the replacement starts
        worker_set.drain(drained.worker_id)
        assert worker_set.find(drained.worker_id).phase is Phase.DRAINING
        await worker_set.remove(drained.worker_id)

        for w in (lost, drained):
            assert isinstance(queues[w.worker_id].get_nowait(), WorkerLost)
            assert worker_set.cached_blocks(w.worker_id) == {}
            assert metrics.registry.get_sample_value("pdserve_running_sequences",
                                                     {"role": "decode", "worker": w.worker_id}) is None
        assert worker_set.find(drained.worker_id).phase is Phase.GONE and worker_set.decode.stopped == ["decode-1"]
        assert metrics.registry.get_sample_value("pdserve_workers_lost_total", {"role": "decode"}) == 1
        # The lost one stays listed, not healthy, until its pool's replacement takes its place.
        assert [(w.worker_id, w.healthy) for w in worker_set.workers(gone=False)] == [("decode-0", False)]

    asyncio.run(run())
