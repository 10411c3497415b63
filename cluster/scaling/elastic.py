"""Workers joining and leaving a running server: the admin API's drain, add and remove.

A drain takes a worker out of placement at once (`Phase.DRAINING`: the seat line and the
routers pick serving workers only), then waits for the requests the coordinator placed on it
(`WorkerState.inflight`) to end there: KV already on its way lands and decodes, streams run
to their end. Past the drain's deadline its requests move: a decode worker's streams end with
`WorkerLost`, which their coordinators answer as they answer a lost worker (the request
continues on another worker as its prompt plus the tokens streamed so far, so the client
sees a pause, never a missing or repeated token), and their aborts free its blocks; a prefill
worker's calls in flight fail when its actor stops, and are retried elsewhere the same way.
Then the worker leaves its pool and its actor is stopped, which frees its GPUs for Ray.

Adding a worker starts one more actor through the pool's own start path; it takes requests
once its actor is ready. On a Ray cluster with an autoscaler, an actor whose resources no node
has free waits for a node to be added (Ray's autoscaler sees the pending actor's request),
within `health.start_timeout_s`; past it the add fails with a line that says so.

A role change is a drain and an add on the same budget: the drained actor's stop frees its
GPUs, and the other role's actor is placed on them (or wherever Ray finds room).
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass

from pdserve.cluster.serving.coordinator import Coordinator
from pdserve.cluster.serving.errors import WorkerLost
from pdserve.cluster.serving.metrics import Metrics
from pdserve.cluster.serving.pools import Phase, Pool, Worker
from pdserve.cluster.settings.pool_config import DrainConfig

logger = logging.getLogger(__name__)


class AdminRefused(Exception):
    """What was asked cannot be done in the pools' present state (FAILED_PRECONDITION)."""


class UnknownWorker(LookupError):
    """No worker of that name (NOT_FOUND)."""


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """One worker as the admin API lists it."""

    worker_id: str
    role: str
    phase: Phase
    num_running: int  # sequences its engine runs (its last load)
    num_queued: int  # sequences waiting in its engine, or for their KV to land
    num_inflight: int  # requests the coordinator placed on it that have not ended

    @classmethod
    def of(cls, worker: Worker) -> WorkerInfo:
        load = worker.state.load
        if load is None or worker.phase is Phase.GONE:
            return cls(worker.worker_id, worker.role, worker.phase, 0, 0, 0)
        return cls(worker.worker_id, worker.role, worker.phase, load.num_running,
                   load.num_waiting + load.num_receiving, worker.state.inflight)


class Elastic:
    def __init__(self, coordinator: Coordinator, config: DrainConfig, metrics: Metrics) -> None:
        self.coordinator = coordinator
        self.config = config
        self.metrics = metrics
        self._drains: dict[str, asyncio.Task[None]] = {}  # by worker id, until the worker is gone

    def workers(self) -> list[WorkerInfo]:
        """Every worker of every pool, live ones first, then the recently gone."""
        pools = self.coordinator.pools()
        return [WorkerInfo.of(w) for p in pools for w in p.workers] + \
               [WorkerInfo.of(w) for p in pools for w in p.gone]

    async def add(self, role: str) -> WorkerInfo:
        """One more worker of `role`, started as the pool's first ones were (bounded by
        `health.start_timeout_s`); it takes requests once it answers."""
        pool = self._pool(role)
        worker = await pool.add()
        if pool is self.coordinator.decode:
            self.coordinator.streams.follow(worker)
            self.coordinator.seats.wake()  # a request waiting for a seat may take one there
        logger.info("admin: added %s worker %s", role, worker.worker_id)
        return WorkerInfo.of(worker)

    async def remove(self, role: str, worker_id: str, deadline_s: float | None, wait: bool) -> WorkerInfo:
        """Drain and stop `worker_id` of `role` ("": the serving worker of `role` with the
        fewest requests)."""
        pool = self._pool(role)
        if not worker_id:
            serving = pool.serving()
            if not serving:
                raise AdminRefused(f"no serving {role} worker to remove")
            worker_id = min(serving, key=lambda w: w.state.inflight).worker_id
        elif pool.find(worker_id) is None:
            raise UnknownWorker(f"no {role} worker {worker_id!r}")
        return await self.drain(worker_id, deadline_s, wait)

    async def change_role(self, worker_id: str, role: str, deadline_s: float | None) -> tuple[WorkerInfo, WorkerInfo]:
        """Drain and stop `worker_id` ("": the serving worker of the other role with the fewest
        requests), then start a worker of `role` in its place. Returns (the drained worker, the
        started one). Raises UnknownWorker, AdminRefused, ValueError."""
        target = self._pool(role)
        if self.coordinator.mode != "disaggregated":
            raise AdminRefused(f"a {self.coordinator.mode} server has one role: nothing to change to")
        source = next(p for p in self.coordinator.pools() if p is not target)
        if not worker_id:
            serving = source.serving()
            if not serving:
                raise AdminRefused(f"no serving {source.role} worker to move to {role}")
            worker_id = min(serving, key=lambda w: w.state.inflight).worker_id
        pool, worker = self._find(worker_id)
        if pool is target:
            raise AdminRefused(f"worker {worker_id} is a {role} worker already")
        if worker.phase is not Phase.SERVING:
            raise AdminRefused(f"worker {worker_id} is {worker.phase.value}: only a serving worker changes role")
        logger.info("admin: moving %s worker %s to %s", pool.role, worker_id, role)
        drained = await self.drain(worker_id, deadline_s, wait=True)
        return drained, await self.add(role)

    async def drain(self, worker_id: str, deadline_s: float | None, wait: bool) -> WorkerInfo:
        """Start draining `worker_id` (a drain under way or done is left as it is); with
        `wait`, return once it is gone. Raises UnknownWorker, AdminRefused."""
        pool, worker = self._find(worker_id)
        if worker.phase is Phase.SERVING:
            if not worker.state.healthy:
                raise AdminRefused(f"{pool.role} worker {worker_id} is lost and being replaced")
            self._check_may_leave(pool, worker)
            deadline = self.config.deadline_s if deadline_s is None else deadline_s
            if not (math.isfinite(deadline) and deadline >= 0):  # NaN would never come
                raise ValueError(f"deadline_s must be a number of seconds >= 0, got {deadline}")
            pool.drain(worker)
            task = asyncio.create_task(self._drain(pool, worker, deadline))
            self._drains[worker_id] = task
            task.add_done_callback(lambda t: self._drained(worker_id, t))
        task = self._drains.get(worker_id)
        if wait and task is not None:
            await asyncio.shield(task)  # the caller leaving does not stop the drain
        return WorkerInfo.of(worker)

    def _drained(self, worker_id: str, task: asyncio.Task[None]) -> None:
        self._drains.pop(worker_id, None)
        if not task.cancelled() and task.exception() is not None:
            logger.error("admin: the drain of %s failed", worker_id, exc_info=task.exception())

    async def stop(self) -> None:
        """Cancel the drains under way (the server stops every worker next)."""
        for task in list(self._drains.values()):
            task.cancel()
        await asyncio.gather(*self._drains.values(), return_exceptions=True)

    def _check_may_leave(self, pool: Pool, worker: Worker) -> None:
        """Refuse to drain the last serving worker of its role while requests need it: those
        on its pool's workers (a draining one's move to a serving one past its deadline), and
        (decode) those waiting for a seat."""
        if any(w is not worker for w in pool.serving()):
            return
        num_running = sum(w.state.inflight for w in pool.workers)
        num_queued = self.coordinator.seats.num_queued if pool is self.coordinator.decode else 0
        if num_running or num_queued:
            raise AdminRefused(
                f"{pool.role} worker {worker.worker_id} is the last serving {pool.role} worker and "
                f"{num_running} request(s) run on {pool.role} workers, {num_queued} wait for one: add a "
                f"{pool.role} worker first (AddWorker), or drain it once they are done")

    async def _drain(self, pool: Pool, worker: Worker, deadline_s: float) -> None:
        logger.info("admin: draining %s worker %s (%d request(s) on it, deadline %.1f s)", pool.role,
                    worker.worker_id, worker.state.inflight, deadline_s)
        if not await self._idle(worker, deadline_s) and pool is self.coordinator.decode:
            logger.warning("admin: %s worker %s still holds %d request(s) at its drain's deadline: moving them",
                           pool.role, worker.worker_id, worker.state.inflight)
            self.coordinator.streams.move(worker, WorkerLost(
                f"{pool.role} worker {worker.worker_id} drained past its deadline"))
            if not await self._idle(worker, self.config.stop_timeout_s):
                logger.warning("admin: %d request(s) did not let go of %s worker %s within %.0f s; stopping it",
                               worker.state.inflight, pool.role, worker.worker_id, self.config.stop_timeout_s)
        # A prefill worker's calls still in flight fail as it stops, and are retried elsewhere.
        await pool.remove(worker)
        self.coordinator.kv_index.remove_worker(worker.worker_id)  # its cached blocks route no one now
        if pool is self.coordinator.decode:
            self.coordinator.streams.forget(worker)
        self.metrics.worker_left(pool.role, worker.worker_id)
        logger.info("admin: %s worker %s drained and stopped", pool.role, worker.worker_id)

    async def _idle(self, worker: Worker, timeout_s: float) -> bool:
        """Whether `worker` has no request placed on it within `timeout_s` (or was lost)."""
        end = asyncio.get_running_loop().time() + timeout_s
        while worker.state.inflight > 0 and worker.state.healthy:
            if asyncio.get_running_loop().time() >= end:
                return False
            await asyncio.sleep(self.config.check_s)
        return True

    def _pool(self, role: str) -> Pool:
        for pool in self.coordinator.pools():
            if pool.role == role:
                return pool
        roles = ", ".join(p.role for p in self.coordinator.pools())
        raise ValueError(f"role must be one of {roles} on this {self.coordinator.mode} server, got {role!r}")

    def _find(self, worker_id: str) -> tuple[Pool, Worker]:
        for pool in self.coordinator.pools():
            worker = pool.find(worker_id)
            if worker is not None:
                return pool, worker
        raise UnknownWorker(f"no worker {worker_id!r} (pdserve workers lists them)")
