"""A CPU decode worker's steps run on `WorkerConfig.decode_cpu_threads` torch threads while no
sequence receives its KV (the prefill workers sharing the node's cores are idle for it), and on
the process's own (Ray's one per CPU) while one does."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from pdserve.decode_node.worker import DecodeWorker, cpu_threads
from pdserve.engine.config import CacheConfig, EngineConfig, WorkerConfig
from pdserve.engine.engine import Engine
from pdserve.engine.messages import WorkerRequest
from pdserve.engine.sampling import SamplingParams

needs_two_cores = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: nothing to raise")


@pytest.fixture
def one_thread():
    """The process at one torch thread, as Ray starts an actor of num_cpus=1 (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _config(small_model) -> EngineConfig:
    return EngineConfig(model=small_model.engine_config(), cache=CacheConfig(cpu_kv_cache_gib=0.05))


@needs_two_cores
def test_the_threads_drop_to_the_process_own_while_a_sequence_receives(small_model, one_thread):
    engine = Engine(_config(small_model))
    try:
        threads = cpu_threads(engine, 2)
        assert threads is not None and threads(engine) == 2
        engine.reserve(WorkerRequest("r", tuple(range(10, 40)), SamplingParams(max_tokens=4)))
        assert threads(engine) == 1
        engine.abort("r")
        assert threads(engine) == 2
        assert cpu_threads(engine, 0) is None
        assert cpu_threads(engine, 64)(engine) == len(os.sched_getaffinity(0))  # at most the cores
    finally:
        engine.close()


@needs_two_cores
def test_a_colocated_worker_steps_on_the_threads_asked_for(small_model, one_thread):
    params = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)

    async def run(wanted: int) -> int:
        worker = DecodeWorker("decode-0", _config(small_model), None, WorkerConfig(decode_cpu_threads=wanted))
        try:
            await worker.submit(WorkerRequest("f0/a", tuple(range(10, 30)), params))
            for _ in range(200):  # until a step ran (bounded)
                if await worker.loop.call(lambda e: e.scheduler.running and e.scheduler.running[0].num_output_tokens):
                    break
                await asyncio.sleep(0.01)
            return await worker.loop.call(lambda e: torch.get_num_threads())  # on the loop's thread
        finally:
            await worker.shutdown()

    assert asyncio.run(run(0)) == 1  # first: the loop's set also becomes torch's count for new threads
    assert asyncio.run(run(2)) == 2
