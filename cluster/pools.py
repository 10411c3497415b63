"""Ray pools of prefill and decode actors: placement, start, health checks, replacement."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from pdserve.cluster.router import WorkerState
from pdserve.kv_transport import PeerAddress

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0  # model load (and a first GGUF conversion) included
PING_TIMEOUT_S = 5.0

# Actor exits and unreachable actors both mean: this worker is gone.
ACTOR_LOST = (RayActorError, GetTimeoutError, asyncio.TimeoutError)


@dataclass(slots=True)
class Worker:
    role: str  # "prefill", "decode" or "mixed"
    actor: Any  # ray.actor.ActorHandle
    state: WorkerState
    address: PeerAddress | None = None

    @property
    def worker_id(self) -> str:
        return self.state.worker_id


@dataclass(frozen=True, slots=True)
class ActorSpec:
    """How to create one pool's actors: the class, its constructor args after the worker id, Ray options."""

    cls: type
    args: tuple[Any, ...]
    num_cpus: float
    num_gpus: float
    resource: str  # custom node resource ("" = none)


class Pool:
    """A fixed-size set of actors of one role. Dead actors are replaced."""

    def __init__(self, role: str, size: int, spec: ActorSpec) -> None:
        self.role = role
        self.size = size
        self.spec = spec
        self.workers: list[Worker] = []
        # Told of a lost worker before it is replaced (the coordinator fails its requests).
        self.on_lost: Callable[[Worker], Awaitable[None]] | None = None
        self._ids = itertools.count()
        self.num_replaced = 0

    def healthy(self) -> list[Worker]:
        return [w for w in self.workers if w.state.healthy]

    async def start(self) -> None:
        self.workers = list(await asyncio.gather(*(self._spawn() for _ in range(self.size))))

    async def _spawn(self) -> Worker:
        worker_id = f"{self.role}-{next(self._ids)}"
        spec = self.spec
        options: dict[str, Any] = {"num_cpus": spec.num_cpus, "num_gpus": spec.num_gpus, "max_restarts": 0,
                                   "max_concurrency": 1000}
        if spec.resource:
            options["resources"] = {spec.resource: 1}
        actor = ray.remote(spec.cls).options(**options).remote(worker_id, *spec.args)
        address = await asyncio.wait_for(actor.start.remote(), START_TIMEOUT_S)
        logger.info("%s worker %s started%s", self.role, worker_id, f" (KV at {address})" if address else "")
        return Worker(self.role, actor, WorkerState(worker_id), address)

    async def check(self) -> None:
        """Ping every worker; a lost one is reported, killed and replaced."""
        results = await asyncio.gather(*(self._ping(w) for w in self.workers))
        for worker, alive in zip(list(self.workers), results):
            if not alive and worker.state.healthy:
                await self.replace(worker)

    async def _ping(self, worker: Worker) -> bool:
        try:
            await asyncio.wait_for(worker.actor.ping.remote(), PING_TIMEOUT_S)
            return True
        except ACTOR_LOST:
            return False

    async def replace(self, worker: Worker) -> None:
        if not worker.state.healthy:
            return
        worker.state.healthy = False
        logger.warning("%s worker %s is lost; replacing it", self.role, worker.worker_id)
        if self.on_lost is not None:
            await self.on_lost(worker)
        ray.kill(worker.actor, no_restart=True)
        try:
            fresh = await self._spawn()
        except Exception:
            logger.exception("could not replace %s worker %s", self.role, worker.worker_id)
            return
        self.workers[self.workers.index(worker)] = fresh
        self.num_replaced += 1

    async def stop(self) -> None:
        for w in self.workers:
            try:
                await asyncio.wait_for(w.actor.shutdown.remote(), PING_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - best effort, the actor is killed next
                pass
            ray.kill(w.actor, no_restart=True)
