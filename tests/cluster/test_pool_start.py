"""A pool's start on real Ray actors: a worker whose process dies before its constructor ends is
created again (up to HealthConfig.start_attempts), one whose constructor raises is not; a
replacement takes its predecessor's slot under an id of its own."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest
from ray import cloudpickle
from ray.exceptions import ActorDiedError

from pdserve.cluster.serving.pools import ActorSpec, Pool
from pdserve.cluster.settings.config import HealthConfig

# Ray's workers cannot import tests/ (they start in pdserve's empty folder, not the
# checkout: cluster/ray_driver.py), so this module's actor class travels by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class _Worker:
    """Counts its constructions in `folder`; the first `crashes` of them end the process outright,
    as the kernel's OOM killer or a segfault would; with `raises`, every one raises instead."""

    def __init__(self, worker_id: str, folder: str, crashes: int, raises: bool, slot: str | None = None) -> None:
        made = len(os.listdir(folder))
        Path(folder, f"{made}").touch()
        if raises:
            raise ValueError("this constructor always fails")
        if made < crashes:
            os._exit(1)
        self.worker_id = worker_id
        self.slot = slot

    def start(self) -> None:
        return None

    def shutdown(self) -> None:
        return None

    def slot_given(self) -> str | None:
        return self.slot


def _pool(folder: Path, crashes: int, raises: bool, attempts: int, size: int = 1) -> Pool:
    spec = ActorSpec(_Worker, (str(folder), crashes, raises), num_cpus=0, num_gpus=0, resource="",
                     max_concurrency=1)
    return Pool("prefill", size, spec, HealthConfig(start_timeout_s=60, start_attempts=attempts))


def test_a_worker_that_died_before_it_started_is_created_again(ray_cluster: None, tmp_path: Path) -> None:
    pool = _pool(tmp_path, crashes=1, raises=False, attempts=2)
    asyncio.run(pool.start())
    assert len(pool.workers) == 1 and pool.workers[0].worker_id == "prefill-0"
    assert len(os.listdir(tmp_path)) == 2  # one crash, one start


def test_attempts_are_bounded(ray_cluster: None, tmp_path: Path) -> None:
    pool = _pool(tmp_path, crashes=5, raises=False, attempts=2)
    with pytest.raises(ActorDiedError):
        asyncio.run(pool.start())
    assert len(os.listdir(tmp_path)) == 2


def test_a_constructor_that_raises_is_not_retried(ray_cluster: None, tmp_path: Path) -> None:
    pool = _pool(tmp_path, crashes=0, raises=True, attempts=3)
    with pytest.raises(ActorDiedError, match="this constructor always fails"):
        asyncio.run(pool.start())
    assert len(os.listdir(tmp_path)) == 1


def test_a_replacement_takes_its_predecessors_slot_and_an_added_worker_the_lowest_free_one(
        ray_cluster: None, tmp_path: Path) -> None:
    async def run() -> list[tuple[str, str | None, str | None]]:
        pool = _pool(tmp_path, crashes=0, raises=False, attempts=1, size=2)
        await pool.start()
        first, second = pool.workers
        await pool.replace(first)  # as when it is found lost: its slot, and so its disk tier, carry over
        await pool.remove(second)
        await pool.add()  # the slot prefill-1 left free
        slots = await asyncio.gather(*(w.actor.slot_given.remote() for w in pool.workers))
        await pool.stop()
        return [(w.worker_id, w.slot, slot) for w, slot in zip(pool.workers, slots)]

    assert asyncio.run(run()) == [("prefill-2", "prefill-0", "prefill-0"), ("prefill-3", "prefill-1", "prefill-1")]
