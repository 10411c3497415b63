"""A frontend's copy of the worker set that the control plane owns (`cluster/control_plane.py`).

The control plane publishes its membership (`Membership`: every worker's actor handle,
address, phase and health, and the frontends it has heard from) under a version; each
frontend follows it with a long poll (`ControlPlaneLink`) and keeps a `MirrorPool` per role,
which the frontend's own `WorkerSet` (its seats, streams and KV index) runs over as over a
real pool. A mirror never starts, stops or replaces an actor: a worker it finds lost leaves
its placement at once and is reported to the control plane, which replaces it. While the
control plane is down the frontend serves on the copy it has.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.cluster.serving.cluster_metrics import Sample
from pdserve.cluster.serving.health import WorkerHealth
from pdserve.cluster.serving.pools import Member, Phase, Pool, Worker
from pdserve.cluster.serving.router import WorkerState
from pdserve.cluster.serving.worker_set import WorkerInfo
from pdserve.cluster.settings.config import HealthConfig

logger = logging.getLogger(__name__)

HEARTBEAT_S = 2.0  # a frontend's membership poll waits this long at most: its heartbeat's period


@dataclass(frozen=True, slots=True)
class FrontendInfo:
    """A frontend process, as it reports itself (`pdserve workers` lists them)."""

    frontend_id: str
    pid: int
    host: str
    port: int  # gRPC
    http_port: int  # 0: no HTTP API
    metrics_port: int = 0


@dataclass(frozen=True, slots=True)
class Membership:
    """The control plane's worker set at one version (`incarnation`: fresh at each start of it)."""

    incarnation: str
    version: int
    members: tuple[Member, ...]
    workers: tuple[WorkerInfo, ...]  # every worker with its load, for the admin API's listing
    frontends: tuple[FrontendInfo, ...]


class MirrorPool(Pool):
    """A role's workers as the control plane last published them."""

    def __init__(self, role: str, health: HealthConfig, report_lost: Callable[[str], None]) -> None:
        super().__init__(role, 0, None, health)
        self._report_lost = report_lost

    async def sync(self, members: list[Member]) -> None:
        """Take the published members of this role: new ones join, phases follow, and a worker
        no longer listed (or listed unhealthy) leaves the way a lost one does."""
        mine = [m for m in members if m.role == self.role]
        listed = {m.worker_id: m for m in mine}
        for worker in list(self.workers):
            m = listed.pop(worker.worker_id, None)
            if m is not None and m.healthy:
                worker.phase = m.phase if m.phase is not Phase.GONE else worker.phase
                continue
            await self._leave(worker)
        now = time.monotonic()
        for m in listed.values():
            if m.healthy:
                self.workers.append(Worker(self.role, m.actor, WorkerState(m.worker_id), WorkerHealth(self.health, now),
                                           m.address, m.phase, m.slot))
        # Listed unhealthy: lost, and being replaced by the control plane (a request finding no
        # serving worker waits for the replacement, `seats.may_wait`).
        self.replacing = sum(not m.healthy for m in mine)

    async def _leave(self, worker: Worker) -> None:
        if worker.state.healthy:
            worker.state.healthy = False
            if self.on_lost is not None:
                await self.on_lost(worker)
        worker.phase = Phase.GONE
        self.workers.remove(worker)
        self.gone.append(worker)

    async def replace(self, worker: Worker, reason: str = "a call found it lost") -> None:
        """Out of placement now; the control plane, told, replaces it (a request finding no
        serving worker meanwhile waits for the replacement: `replacing`)."""
        if not worker.state.healthy:
            return
        worker.state.healthy = False
        self.replacing += 1
        logger.warning("%s worker %s is lost (%s); the control plane replaces it", self.role, worker.worker_id, reason)
        if self.on_lost is not None:
            await self.on_lost(worker)
        self._report_lost(worker.worker_id)

    async def check(self) -> None:
        """The control plane pings the workers: nothing to do here."""

    async def add(self) -> Worker:
        raise RuntimeError("workers are added by the control plane (the admin API)")

    async def remove(self, worker: Worker) -> None:
        raise RuntimeError("workers are removed by the control plane (the admin API)")

    async def stop(self) -> None:
        """The workers are the control plane's: a frontend's stop leaves them running."""


class ControlPlaneLink:
    """A frontend's side of the control plane: its membership followed into the mirrors, this
    frontend's heartbeat (and its request metrics, `samples`) carried on each poll, lost
    workers reported. Survives the control
    plane's death: the mirrors keep the last membership until it answers again."""

    def __init__(self, actor: Any, me: FrontendInfo | None, mirrors: list[MirrorPool], wait_s: float = HEARTBEAT_S,
                 retry_s: float = 1.0) -> None:
        self.actor = actor
        self.me = me
        self.mirrors = mirrors
        self.wait_s = wait_s
        self.retry_s = retry_s
        self.membership: Membership | None = None
        self.samples: Callable[[], tuple[Sample, ...]] | None = None
        self.reachable = True
        self._tasks: set[asyncio.Task] = set()

    async def refresh(self, wait_s: float = 0.0) -> Membership:
        """One poll (answered at once when the control plane's version is not ours)."""
        known = ("", -1) if self.membership is None else (self.membership.incarnation, self.membership.version)
        samples = self.samples() if self.samples is not None and self.me is not None else ()
        m: Membership = await self.actor.membership.remote(known, wait_s, self.me, samples)
        if self.membership is None or (m.incarnation, m.version) != known:
            for mirror in self.mirrors:
                await mirror.sync(list(m.members))
        self.membership = m
        return m

    async def follow(self) -> None:
        while True:
            try:
                await self.refresh(self.wait_s)
                if not self.reachable:
                    logger.warning("control plane answers again")
                self.reachable = True
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - dead or restarting: serve on the copy we have
                if self.reachable:
                    logger.warning("control plane unreachable (%s): serving on the cached worker set",
                                   type(e).__name__)
                self.reachable = False
                await asyncio.sleep(self.retry_s)

    def report_lost(self, worker_id: str) -> None:
        task = asyncio.ensure_future(self._report(worker_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _report(self, worker_id: str) -> None:
        try:
            await self.actor.report_lost.remote(worker_id)
        except Exception:  # noqa: BLE001 - its own health loop finds the worker too
            logger.warning("could not tell the control plane that worker %s is lost", worker_id)

    async def admin(self, method: str, *args: Any) -> Any:
        """An admin call run by the control plane (`ControlPlane.admin`)."""
        return await self.actor.admin.remote(method, *args)
