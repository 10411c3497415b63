"""A colocated decode worker bounds what it queues whichever frontends send it: `max_num_seqs`
running plus `WorkerConfig.max_queued` waiting, then NoCapacity (each frontend's own seat line
counts only its share)."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.decode_node.worker import DecodeWorker
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig, WorkerConfig
from pdserve.engine.kv_handoff import NoCapacity
from pdserve.engine.messages import WorkerRequest
from pdserve.engine.sampling import SamplingParams


def test_a_colocated_worker_refuses_beyond_its_seats_and_its_queue(small_model):
    config = EngineConfig(model=small_model.engine_config(), cache=CacheConfig(cpu_kv_cache_gib=0.05),
                          scheduler=SchedulerConfig(max_num_seqs=1))
    params = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)

    def request(rid: str) -> WorkerRequest:
        return WorkerRequest(rid, tuple(range(10, 30)), params)

    async def run() -> None:
        worker = DecodeWorker("decode-0", config, None, WorkerConfig(max_queued=1))
        try:
            await worker.submit(request("f0/a"))  # runs
            await worker.submit(request("f1/b"))  # waits: another frontend's, the same bound
            with pytest.raises(NoCapacity, match="worker.max_queued"):
                await worker.submit(request("f0/c"))
            assert await worker.abort("f0/a")
            await worker.submit(request("f1/d"))  # a seat freed: taken again
        finally:
            await worker.shutdown()

    asyncio.run(run())
