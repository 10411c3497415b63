"""A prefill worker cuts the prefills of a frontend whose lease ran out: a prompt caught
mid-computation (chunked over many steps) for a frontend that stopped renewing is cut, its
blocks freed, while a live frontend's prefill, renewed, completes with its first token; an
unnamed owner (a single server's) holds no lease."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig, WorkerConfig
from pdserve.engine.messages import WorkerRequest
from pdserve.engine.sampling import SamplingParams
from pdserve.kv_transport import TransportConfig
from pdserve.prefill_node.worker import PrefillWorker

LEASE_S = 2.0


def _mid_prefill(rid: str, held: threading.Event, gate: threading.Event):
    """An engine command: if `rid` runs with part of its prompt computed, hold the engine there
    (`held` set) until `gate`; else return at once."""
    def command(engine) -> None:
        seq = next((s for s in engine.scheduler.running if s.request_id == rid), None)
        if seq is not None and 0 < seq.num_computed_tokens < seq.num_prompt_tokens:
            held.set()
            gate.wait(60)
    return command


def test_a_dead_frontends_prefill_is_cut_mid_prompt_and_frees_its_blocks(small_model):
    config = EngineConfig(model=small_model.engine_config(), cache=CacheConfig(cpu_kv_cache_gib=0.05),
                          scheduler=SchedulerConfig(max_num_batched_tokens=16))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = tuple(range(100, 400))  # ~19 chunked steps

    async def run() -> None:
        worker = PrefillWorker("prefill-0", config, TransportConfig(secret=b"s" * 32),
                               WorkerConfig(frontend_lease_s=LEASE_S))
        await worker.start()
        held, gate = threading.Event(), threading.Event()

        async def renew_f1() -> None:  # a live frontend's lease loop (WorkerSet._lease_loop)
            while True:
                await worker.renew_lease("f1")
                await asyncio.sleep(0.1)

        renewing = asyncio.ensure_future(renew_f1())
        try:
            dead = asyncio.ensure_future(worker.prefill(WorkerRequest("f0/a", prompt, params), None))
            live = asyncio.ensure_future(worker.prefill(WorkerRequest("f1/b", prompt[:40], params), None))
            single = asyncio.ensure_future(worker.prefill(WorkerRequest("c", prompt[:30], params), None))
            give_up = time.monotonic() + 60
            while not held.is_set():
                assert time.monotonic() < give_up, "f0/a never seen mid-prompt"
                assert not dead.done(), "f0/a ended before it was held mid-prompt"
                command = worker.loop.submit(_mid_prefill("f0/a", held, gate))
                while not (command.done() or held.is_set()):
                    await asyncio.sleep(0.005)
            # The engine is held with f0/a mid-prompt; f1 renews its lease, f0 has died.
            while worker.lease_cuts.get("f0") is None:
                assert time.monotonic() < give_up, "the lease of f0 was never cut"
                await asyncio.sleep(0.05)
            assert await worker.expired_leases() == {"f0": 1}
            gate.set()
            with pytest.raises(asyncio.CancelledError):
                await dead
            out = await live
            assert len(out.first.token_ids) == 1 and out.needs_decode
            assert (await single).needs_decode  # no owner: no lease to run out
            assert await worker.expired_leases() == {"f0": 1}
            load = await worker.load()
            assert load.num_running + load.num_waiting == 0
            assert load.num_free_blocks == load.num_blocks
        finally:
            gate.set()
            renewing.cancel()
            await worker.shutdown()

    asyncio.run(run())
