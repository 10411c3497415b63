"""Workers joining and leaving a running server: the admin API's drain, add and remove.

A drain takes a worker out of placement at once (`Phase.DRAINING`: the seat line and the
routers pick serving workers only), then waits for the requests the coordinator placed on it
(`WorkerState.inflight`) to end there: KV already on its way lands and decodes, streams run
to their end. Past the drain's deadline its requests move: a decode worker's streams end with
`WorkerLost`, which their coordinators answer as they answer a lost worker (the request
continues on another worker as its prompt plus the tokens streamed so far, so the client
sees a pause, never a missing or repeated token), and their aborts free its blocks; a prefill
worker's calls in flight fail when its actor stops, and are retried elsewhere the same way.
Then the worker leaves the worker set (`WorkerSet.remove`: the same path as a lost worker's) and
its actor is stopped, which frees its GPUs for Ray. Elastic speaks to the worker set by worker
id and role only (`WorkerSet`'s seam).

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

from pdserve.cluster.serving.pools import Phase
from pdserve.cluster.serving.worker_set import UnknownWorker, WorkerInfo, WorkerSet
from pdserve.cluster.settings.pool_config import DrainConfig

logger = logging.getLogger(__name__)


class AdminRefused(Exception):
    """What was asked cannot be done in the pools' present state (FAILED_PRECONDITION)."""


class Elastic:
    def __init__(self, worker_set: WorkerSet, config: DrainConfig) -> None:
        self.worker_set = worker_set
        self.config = config
        self._drains: dict[str, asyncio.Task[None]] = {}  # by worker id, until the worker is gone

    def workers(self) -> list[WorkerInfo]:
        """Every worker of every pool, live ones first, then the recently gone."""
        return self.worker_set.workers()

    async def add(self, role: str) -> WorkerInfo:
        """One more worker of `role`, started as the pool's first ones were (bounded by
        `health.start_timeout_s`); it takes requests once it answers."""
        self._check_role(role)
        info = await self.worker_set.add(role)
        logger.info("admin: added %s worker %s", role, info.worker_id)
        return info

    async def remove(self, role: str, worker_id: str, deadline_s: float | None, wait: bool) -> WorkerInfo:
        """Drain and stop `worker_id` of `role` ("": the serving worker of `role` with the
        fewest requests)."""
        self._check_role(role)
        if not worker_id:
            least_busy = self.worker_set.least_busy(role)
            if least_busy is None:
                raise AdminRefused(f"no serving {role} worker to remove")
            worker_id = least_busy
        else:
            known = self.worker_set.find(worker_id)
            if known is None or known.role != role:
                raise UnknownWorker(f"no {role} worker {worker_id!r}")
        return await self.drain(worker_id, deadline_s, wait)

    async def change_role(self, worker_id: str, role: str, deadline_s: float | None) -> tuple[WorkerInfo, WorkerInfo]:
        """Drain and stop `worker_id` ("": the serving worker of the other role with the fewest
        requests), then start a worker of `role` in its place. Returns (the drained worker, the
        started one). Raises UnknownWorker, AdminRefused, ValueError."""
        self._check_role(role)
        mode = self.worker_set.mode
        if mode != "disaggregated":
            raise AdminRefused(f"a {mode} server has one role: nothing to change to")
        source = next(r for r in self.worker_set.roles() if r != role)
        if not worker_id:
            least_busy = self.worker_set.least_busy(source)
            if least_busy is None:
                raise AdminRefused(f"no serving {source} worker to move to {role}")
            worker_id = least_busy
        worker = self._find(worker_id)
        if worker.role == role:
            raise AdminRefused(f"worker {worker_id} is a {role} worker already")
        if worker.phase is not Phase.SERVING:
            raise AdminRefused(f"worker {worker_id} is {worker.phase.value}: only a serving worker changes role")
        logger.info("admin: moving %s worker %s to %s", worker.role, worker_id, role)
        drained = await self.drain(worker_id, deadline_s, wait=True)
        return drained, await self.add(role)

    async def drain(self, worker_id: str, deadline_s: float | None, wait: bool) -> WorkerInfo:
        """Start draining `worker_id` (a drain under way or done is left as it is); with
        `wait`, return once it is gone. Raises UnknownWorker, AdminRefused."""
        worker = self._find(worker_id)
        if worker.phase is Phase.SERVING:
            if not worker.healthy:
                raise AdminRefused(f"{worker.role} worker {worker_id} is lost and being replaced")
            self._check_may_leave(worker)
            deadline = self.config.deadline_s if deadline_s is None else deadline_s
            if not (math.isfinite(deadline) and deadline >= 0):  # NaN would never come
                raise ValueError(f"deadline_s must be a number of seconds >= 0, got {deadline}")
            self.worker_set.drain(worker_id)
            task = asyncio.create_task(self._drain(worker.role, worker_id, deadline))
            self._drains[worker_id] = task
            task.add_done_callback(lambda t: self._drained(worker_id, t))
        task = self._drains.get(worker_id)
        if wait and task is not None:
            await asyncio.shield(task)  # the caller leaving does not stop the drain
        return self._find(worker_id)

    def _drained(self, worker_id: str, task: asyncio.Task[None]) -> None:
        self._drains.pop(worker_id, None)
        if not task.cancelled() and task.exception() is not None:
            logger.error("admin: the drain of %s failed", worker_id, exc_info=task.exception())

    async def stop(self) -> None:
        """Cancel the drains under way (the server stops every worker next)."""
        for task in list(self._drains.values()):
            task.cancel()
        await asyncio.gather(*self._drains.values(), return_exceptions=True)

    def _check_may_leave(self, worker: WorkerInfo) -> None:
        """Refuse to drain the last serving worker of its role (`worker`, serving) while
        requests need it: those on its pool's workers (a draining one's move to a serving one
        past its deadline), and (decode) those waiting for a seat."""
        role = self.worker_set.summary(worker.role)
        if role.num_serving > 1:
            return
        if role.num_inflight or role.num_queued:
            raise AdminRefused(
                f"{worker.role} worker {worker.worker_id} is the last serving {worker.role} worker and "
                f"{role.num_inflight} request(s) run on {worker.role} workers, {role.num_queued} wait for one: "
                f"add a {worker.role} worker first (AddWorker), or drain it once they are done")

    async def _drain(self, role: str, worker_id: str, deadline_s: float) -> None:
        logger.info("admin: draining %s worker %s (%d request(s) on it, deadline %.1f s)", role,
                    worker_id, self.worker_set.num_placed(worker_id), deadline_s)
        if not await self._idle(worker_id, deadline_s) and self.worker_set.move_requests(
                worker_id, f"{role} worker {worker_id} drained past its deadline"):
            logger.warning("admin: %s worker %s still held %d request(s) at its drain's deadline: moved them",
                           role, worker_id, self.worker_set.num_placed(worker_id))
            if not await self._idle(worker_id, self.config.stop_timeout_s):
                logger.warning("admin: %d request(s) did not let go of %s worker %s within %.0f s; stopping it",
                               self.worker_set.num_placed(worker_id), role, worker_id, self.config.stop_timeout_s)
        # A prefill worker's calls still in flight fail as it stops, and are retried elsewhere.
        await self.worker_set.remove(worker_id)
        logger.info("admin: %s worker %s drained and stopped", role, worker_id)

    async def _idle(self, worker_id: str, timeout_s: float) -> bool:
        """Whether `worker_id` has no request placed on it within `timeout_s` (or was lost)."""
        end = asyncio.get_running_loop().time() + timeout_s
        while self.worker_set.num_placed(worker_id) > 0:
            if asyncio.get_running_loop().time() >= end:
                return False
            await asyncio.sleep(self.config.check_s)
        return True

    def _check_role(self, role: str) -> None:
        roles = self.worker_set.roles()
        if role not in roles:
            raise ValueError(f"role must be one of {', '.join(roles)} on this {self.worker_set.mode} server, "
                             f"got {role!r}")

    def _find(self, worker_id: str) -> WorkerInfo:
        worker = self.worker_set.find(worker_id)
        if worker is None:
            raise UnknownWorker(f"no worker {worker_id!r} (pdserve workers lists them)")
        return worker
