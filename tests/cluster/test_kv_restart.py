"""KV tiers and the router's index across lost workers (real Ray, real UCX, the small model):
a prefill worker SIGKILLed and replaced in its slot serves a conversation's second turn from
the disk tier its predecessor wrote; and after evictions, preemptions, a migration, worker
restarts and a dropped event, the index equals, block by block and tier by tier, what each
live worker holds, and holds nothing of the lost ones."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from pdserve.cluster.clients.grpc_client import Client
from pdserve.cluster.serving.pools import Worker
from pdserve.cluster.serving.worker_set import WorkerSet
from pdserve.engine.block_hash import prefix_block_hashes
from pdserve.engine.kv.events import DEVICE_TIER, DISK_TIER
from pdserve.engine.messages import WorkerRequest
from pdserve.engine.outputs import EngineLoad
from pdserve.engine.sampling import SamplingParams
from tests.cluster.conftest import RunningServer
from tests.cluster.streams import collect, pools_are_full, wait_until
from tests.engine.prompts import prompt_ids

BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=3)
LONG = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kv-disk")


@pytest.fixture(scope="module")
def srv(start, disk_dir: Path) -> RunningServer:
    # 24 blocks a pool: a few prompts evict one, a few long answers preempt on a decode worker.
    # No host tier: what a pool evicts goes straight to disk, which a restart keeps.
    return start(pools={"num_prefill": 1, "num_decode": 2, "routing": "prefix_aware"},
                 engine={"cache": {"num_blocks": 24}, "kv_tiers": {"disk_dir": str(disk_dir)}})


def _worker_set(srv: RunningServer) -> WorkerSet:
    return srv.server.worker_set


def _live(srv: RunningServer) -> list[Worker]:
    return [w for p in _worker_set(srv).pools() for w in p.workers if w.state.healthy]


def _ask(srv: RunningServer, method: str, workers: list[Worker]) -> list[Any]:
    """One actor method's answers from `workers`, awaited on the server's loop."""
    async def ask() -> list[Any]:
        return list(await asyncio.gather(*(getattr(w.actor, method).remote() for w in workers)))

    return srv.run(ask())


def _index_equals_the_workers(srv: RunningServer) -> bool:
    """Block by block, tier by tier: the index holds exactly what each live worker's snapshot
    says it holds (no tier missing, none extra)."""
    index = _worker_set(srv).kv_index
    workers = _live(srv)
    for worker, snap in zip(workers, _ask(srv, "kv_snapshot", workers)):
        held = {tier: set(hashes) for tier, hashes in snap.block_hashes.items() if hashes}
        if {tier: hashes for tier, hashes in index.hashes_of(worker.worker_id).items() if hashes} != held:
            return False
    return True


def _kill(worker: Worker) -> None:
    """SIGKILL the worker's process, as a crash or the OOM killer would."""
    import ray

    pid = ray.get(worker.actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
    os.kill(pid, signal.SIGKILL)


def _replacement(srv: RunningServer, lost: Worker) -> Worker:
    """The worker that took `lost`'s slot, once it serves."""
    pool = _worker_set(srv).prefill if lost.role == "prefill" else _worker_set(srv).decode
    found: list[Worker] = []

    def replaced() -> bool:
        found[:] = [w for w in pool.workers if w.slot == lost.slot and w is not lost and w.state.healthy
                    and w.state.load is not None]
        return bool(found)

    wait_until(replaced, 60, f"{lost.worker_id}'s replacement in slot {lost.slot}")
    return found[0]


def test_a_prefill_worker_restarted_in_its_slot_serves_a_second_turn_from_disk(srv, engine, tokenizer, disk_dir):
    index = _worker_set(srv).kv_index
    old = _worker_set(srv).prefill.workers[0]
    first = prompt_ids(tokenizer, 160, variant=61)  # 10 full blocks
    answer = collect(srv.target, first, GREEDY).token_ids
    hashes = prefix_block_hashes(first, BLOCK)
    wait_until(lambda: index.prefix_blocks(hashes).get(old.worker_id) == len(hashes), 30,
               "the first turn's blocks in the prefill worker's pool, as its events say")
    # Other prompts on the prefill worker until its pool holds none of the first turn's blocks:
    # evicted, they went to its disk tier.
    for variant in range(62, 70):
        if not index.prefix_blocks(hashes).get(old.worker_id):
            break
        _prefill_directly(srv, old, prompt_ids(tokenizer, 200, variant=variant))
        wait_until(lambda: _index_equals_the_workers(srv), 30, "the index to catch up")
    wait_until(lambda: index.prefix_blocks(hashes, DISK_TIER).get(old.worker_id) == len(hashes), 30,
               "the first turn's blocks on the prefill worker's disk, as its events say")
    assert not index.prefix_blocks(hashes).get(old.worker_id)

    _kill(old)
    new = _replacement(srv, old)
    assert new.worker_id != old.worker_id and new.slot == old.slot == "prefill-0"
    assert sorted(p.name for p in disk_dir.iterdir()) == ["decode-0", "decode-1", "prefill-0"]
    # The lost worker's entries left the index; the replacement's scan of the slot's folder entered it.
    assert index.blocks_of(old.worker_id) == {}
    wait_until(lambda: index.prefix_blocks(hashes, DISK_TIER).get(new.worker_id) == len(hashes), 30,
               "the replacement's disk blocks in the index")

    second = first + answer + prompt_ids(tokenizer, 40, variant=70)
    got = collect(srv.target, second, GREEDY)
    assert got.token_ids == engine.generate([second], GREEDY)[0].token_ids  # a cold run's greedy tokens
    assert got.num_cached_tokens == len(first)
    # The first turn came from disk: the worker computed the rest only (as its next load report says).
    wait_until(lambda: _reported(new).prompt_tokens_computed == len(second) - len(first), 30,
               f"{len(second) - len(first)} prompt tokens computed (reported: {_reported(new).prompt_tokens_computed})")
    tiers = _reported(new).kv_tiers
    assert tiers is not None and tiers.hit_tokens[DISK_TIER] == len(first)


def test_the_index_equals_every_worker_after_preemptions_a_migration_restarts_and_a_lost_event(srv, engine,
                                                                                                tokenizer):
    import ray

    worker_set = _worker_set(srv)
    index = worker_set.kv_index
    lost_ids: list[str] = []

    # Preemptions: long answers side by side outgrow the decode pools (24 blocks each; a seat
    # reserves its prompt's 4 blocks and one more, the answer grows to 14).
    preempted = _preemptions(srv)
    prompts = [prompt_ids(tokenizer, 64, variant=80 + i) for i in range(6)]
    params = dataclasses.replace(LONG, max_tokens=160)
    results: list[list[int]] = [[] for _ in prompts]
    threads = [threading.Thread(target=lambda i=i: results[i].extend(collect(srv.target, prompts[i], params).token_ids))
               for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == [r.token_ids for r in engine.generate(prompts, params)]
    wait_until(lambda: _preemptions(srv) > preempted, 30, "the decode workers' reports of a preemption")

    # A migration: the decode worker streaming a request is SIGKILLed mid-stream; the request
    # continues elsewhere and the worker is replaced in its slot (finding its disk tier).
    prompt = prompt_ids(tokenizer, 96, variant=90)
    want = engine.generate([prompt], LONG)[0].token_ids
    migrations = _migrations(srv)
    got: list[int] = []
    victim: Worker | None = None
    with Client(srv.target) as client:
        for resp in client.generate(prompt, LONG, timeout_s=120):
            got.extend(resp.token_ids)
            if victim is None and len(got) >= 4:
                victim = next(w for w in worker_set.decode.workers if w.state.inflight)
                _kill(victim)
    assert victim is not None and got == want and _migrations(srv) == migrations + 1
    lost_ids.append(victim.worker_id)
    _replacement(srv, victim)

    # A lost event: the prefill worker spends an event number it never sends (as on an
    # overflow of its buffer); the router resyncs it from a snapshot.
    snapshots = index.num_snapshots
    prefill = worker_set.prefill.workers[0]

    def skip_an_event_number(actor_self: Any) -> None:
        def skip(e: Any) -> None:
            e.kv_events.next_seq += 1

        actor_self.loop.submit(skip).result(30)

    ray.get(prefill.actor.__ray_call__.remote(skip_an_event_number), timeout=30)
    collect(srv.target, prompt_ids(tokenizer, 120, variant=91), GREEDY)
    wait_until(lambda: index.num_snapshots > snapshots, 30, "the router to resync the prefill worker")

    # Every event flushed: the index is what the workers hold, and nothing of the lost ones.
    wait_until(lambda: pools_are_full(srv.target), 60, "every block to be free")
    wait_until(lambda: _index_equals_the_workers(srv), 30, "the index to equal every worker's snapshot")
    assert all(index.blocks_of(w) == {} for w in lost_ids)
    tiers = {tier for w in _live(srv) for tier in index.blocks_of(w.worker_id)}
    assert {DEVICE_TIER, DISK_TIER} <= tiers and all(index.in_sync(w.worker_id) for w in _live(srv))


def _reported(worker: Worker) -> EngineLoad:
    """The worker's last load report, as the router has it (reading the worker's load here would
    take its KV events from the router)."""
    load = worker.state.load
    assert load is not None
    return load


def _preemptions(srv: RunningServer) -> int:
    return sum(_reported(w).num_preemptions for w in _worker_set(srv).decode.workers if w.state.load)


def _prefill_directly(srv: RunningServer, worker: Worker, prompt: list[int]) -> None:
    """Prefill `prompt` on `worker`, past the router (its KV sent nowhere, its blocks cached)."""
    req = WorkerRequest(f"direct-{len(prompt)}-{prompt[0]}-{prompt[-1]}", tuple(prompt), dataclasses.replace(GREEDY))

    async def call() -> None:
        await worker.actor.prefill.remote(req, None)

    srv.run(call())


def _migrations(srv: RunningServer) -> float:
    return sum(s.value for m in srv.server.metrics.migrations.collect() for s in m.samples
               if s.name.endswith("_total"))
