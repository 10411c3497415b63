"""Ray pools of prefill and decode actors: placement, start, health checks, replacement, and
workers joining (`add`) and leaving (`remove`) at run time.

Each actor has a concurrency group of its own for pings (`HEALTH_GROUP`): Ray runs it
on a separate thread and event loop, so a ping never waits behind the engine or
behind the actor's other calls. A worker is replaced when Ray reports it dead, or
when `WorkerHealth` finds it wedged (no answers) or stuck (no progress).

Each worker has an id of its own (`prefill-3`: never reused, so the router's index, the
token streams and the metrics never mistake a replacement for the worker it replaced) and a
slot (`prefill-0`), the place it fills in its pool: its replacement takes the same slot, a
worker added later the lowest free one. The slot names the worker's local state that should
outlive it, its KV disk tier (`<kv_tiers.disk_dir>/<slot>/`, `EngineConfig.for_worker`): a
worker restarted in its slot finds the blocks its predecessor wrote there (each checked
against the model and layout before it is served, `engine/kv/disk.py`). A lost worker's
process may outlive `ray.kill` by a moment: a block file it finishes after its replacement
scanned the folder is whole (written under a temporary name, then renamed) but not indexed,
and stays unused until the next restart's scan or a wipe.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import ActorDiedError, RayActorError

from pdserve.cluster.serving.health import WorkerHealth
from pdserve.cluster.serving.router import WorkerState
from pdserve.cluster.settings.config import HealthConfig
from pdserve.engine.loop import Heartbeat
from pdserve.kv_transport import PeerAddress

logger = logging.getLogger(__name__)

HEALTH_GROUP = "health"

# Ray's word that the actor is gone (died, or unreachable). A timeout is not: a worker
# may be busy in a long step, and a TimeoutError raised inside a call is that call's.
ACTOR_LOST = (RayActorError,)

# A control plane's workers are named this plus their id in its namespace (`Pool.namespace`).
WORKER_NAME_PREFIX = "worker-"

# Workers that left, kept for the admin API's listing (the newest this many).
NUM_GONE_KEPT = 64


class WorkerStartTimeout(TimeoutError):
    """A worker's actor was not placed and started within `HealthConfig.start_timeout_s`."""


class Phase(enum.Enum):
    """Where a worker stands in its pool: takes new requests, finishes the ones it has
    (draining, `cluster.elastic`), or has left (its actor stopped)."""

    SERVING = "serving"
    DRAINING = "draining"
    GONE = "gone"


@dataclass(slots=True)
class Worker:
    role: str  # "prefill", "decode" or "mixed"
    actor: Any  # ray.actor.ActorHandle
    state: WorkerState
    health: WorkerHealth
    address: PeerAddress | None = None
    phase: Phase = Phase.SERVING
    slot: str | None = None  # its place in the pool (None: a stand-in's, which has none)

    @property
    def worker_id(self) -> str:
        return self.state.worker_id


@dataclass(frozen=True, slots=True)
class Member:
    """One live worker as the control plane publishes it."""

    worker_id: str
    role: str
    actor: Any  # ray.actor.ActorHandle: Ray sends it to any process
    address: PeerAddress | None
    slot: str | None
    phase: Phase
    healthy: bool

    @classmethod
    def of(cls, worker: Worker) -> Member:
        return cls(worker.worker_id, worker.role, worker.actor, worker.address, worker.slot, worker.phase,
                   worker.state.healthy)


@dataclass(frozen=True, slots=True)
class ActorSpec:
    """How to create one pool's actors: the class, its constructor args after the worker id, Ray options."""

    cls: type
    args: tuple[Any, ...]
    num_cpus: float
    num_gpus: float
    resource: str  # custom node resource ("" = none)
    max_concurrency: int = 1000  # PoolConfig.actor_max_concurrency


class Pool:
    """The actors of one role: `size` of them at the start, more or fewer as workers are added
    and removed. A serving actor that dies is replaced; a draining one is not (it was leaving)."""

    def __init__(self, role: str, size: int, spec: ActorSpec | None, health: HealthConfig | None = None,
                 namespace: str | None = None) -> None:
        self.role = role
        # Set (the control plane's pools): its actors are detached and named `worker-<id>` in this
        # Ray namespace, so that they outlive the control plane and its restart adopts them.
        self.namespace = namespace
        self.size = size  # workers started with the pool
        self.spec = spec
        self.health = health or HealthConfig()
        self.workers: list[Worker] = []  # serving and draining
        self.gone: collections.deque[Worker] = collections.deque(maxlen=NUM_GONE_KEPT)
        # Told of a lost worker before it is replaced (the coordinator fails its requests).
        self.on_lost: Callable[[Worker], Awaitable[None]] | None = None
        self._ids = itertools.count()
        self._starting: set[str] = set()  # slots of workers being spawned
        self.num_replaced = 0
        self.replacing = 0  # replacements under way: a request finding no healthy worker may wait for one

    def healthy(self) -> list[Worker]:
        """The live workers, draining ones included (they are pinged, polled and read)."""
        return [w for w in self.workers if w.state.healthy]

    def serving(self) -> list[Worker]:
        """The live workers that take new requests: not draining."""
        return [w for w in self.workers if w.state.healthy and w.phase is Phase.SERVING]

    def find(self, worker_id: str) -> Worker | None:
        """The worker of that id, live or gone (None: not of this pool)."""
        return next((w for w in (*self.workers, *self.gone) if w.worker_id == worker_id), None)

    async def start(self) -> None:
        """Start the pool's first workers (none if it adopted running ones, `adopt`); if one fails
        (or the start is cancelled), the others are stopped, those started included, before the
        error is raised."""
        if self.workers:
            return
        spawning = [asyncio.ensure_future(self._spawn()) for _ in range(self.size)]
        try:
            self.workers = list(await asyncio.gather(*spawning))
        except BaseException:
            for task in spawning:
                task.cancel()  # a worker still starting kills its actor (_start_actor)
            done = await asyncio.gather(*spawning, return_exceptions=True)
            for worker in done:
                if isinstance(worker, Worker):
                    ray.kill(worker.actor, no_restart=True)
            raise

    def adopt(self, found: list[tuple[Any, str, str | None, PeerAddress | None]]) -> None:
        """Take running actors (handle, worker id, slot, address) as this pool's workers: a
        restarted control plane's, found by name. New ids continue after theirs."""
        now = time.monotonic()
        self.workers = [Worker(self.role, actor, WorkerState(wid), WorkerHealth(self.health, now), address,
                               slot=slot) for actor, wid, slot, address in found]
        last = max((int(wid.rsplit("-", 1)[1]) for _, wid, _, _ in found), default=-1)
        self._ids = itertools.count(last + 1)

    async def add(self) -> Worker:
        """One more worker, started as the pool's first ones are (`_spawn`), serving once its
        actor is ready: the caller registers it where requests are placed."""
        worker = await self._spawn()
        self.workers.append(worker)
        return worker

    def drain(self, worker: Worker) -> None:
        """`worker` takes no new request from now on (`serving()` leaves it out); it stays live,
        pinged and polled, until `remove`. The pool is the one writer of a worker's phase."""
        worker.phase = Phase.DRAINING

    async def remove(self, worker: Worker) -> None:
        """`worker` leaves: no longer listed as live, its actor stopped and its resources freed.
        The caller has let its requests finish or move (`cluster.elastic`)."""
        if worker.phase is Phase.GONE:
            return
        worker.phase = Phase.GONE
        worker.state.healthy = False  # its poller and the load loop let go of it
        self.workers.remove(worker)
        self.gone.append(worker)
        await self._stop_actor(worker)
        logger.info("%s worker %s left its pool", self.role, worker.worker_id)

    def _free_slot(self) -> str:
        """The lowest slot no live or starting worker fills."""
        taken = self._starting | {w.slot for w in self.workers}
        return next(slot for i in itertools.count() if (slot := f"{self.role}-{i}") not in taken)

    async def _spawn(self, slot: str | None = None) -> Worker:
        """A started worker in `slot` (None: the lowest free one). Ray at times reports an actor dead
        before its constructor ran (it never got a process); that one is created again, up to
        `HealthConfig.start_attempts` times."""
        worker_id = f"{self.role}-{next(self._ids)}"
        slot = slot or self._free_slot()
        self._starting.add(slot)
        try:
            for attempt in range(1, self.health.start_attempts + 1):
                try:
                    actor, address = await self._start_actor(worker_id, slot)
                    break
                except ActorDiedError as e:
                    if e.actor_init_failed or attempt == self.health.start_attempts:
                        raise
                    logger.warning("%s worker %s died before it started; creating it again (attempt %d of %d): %s",
                                   self.role, worker_id, attempt + 1, self.health.start_attempts, e)
        finally:
            self._starting.discard(slot)
        logger.info("%s worker %s started in slot %s%s", self.role, worker_id, slot,
                    f" (KV at {address})" if address else "")
        return Worker(self.role, actor, WorkerState(worker_id), WorkerHealth(self.health, time.monotonic()), address,
                      slot=slot)

    async def _start_actor(self, worker_id: str, slot: str) -> tuple[Any, PeerAddress | None]:
        spec = self.spec
        # No task events: the coordinator's pings, load reads and long polls are one actor call
        # each, and Ray keeps an event of every call in the GCS (it grew ~2-4 MiB a minute in
        # the soak); nothing of pdserve reads Ray's task state.
        options: dict[str, Any] = {"num_cpus": spec.num_cpus, "num_gpus": spec.num_gpus, "max_restarts": 0,
                                   "max_concurrency": spec.max_concurrency, "enable_task_events": False}
        if spec.resource:
            options["resources"] = {spec.resource: 1}
        if self.namespace is not None:
            options.update(name=f"{WORKER_NAME_PREFIX}{worker_id}", namespace=self.namespace, lifetime="detached")
        cls = ray.remote(concurrency_groups={HEALTH_GROUP: 1})(spec.cls)  # not settable in .options()
        actor = cls.options(**options).remote(worker_id, *spec.args, slot=slot)
        started = asyncio.ensure_future(_result(actor.start.remote()))
        try:
            waited, timeout = 0.0, self.health.start_timeout_s
            while not started.done():
                step = min(self.health.start_report_s, timeout - waited)
                if step <= 0:
                    # Pending placement counts too: an actor that no node has room for waits for Ray's
                    # autoscaler to add one, and a cluster without one (or at its max) never does.
                    raise WorkerStartTimeout(f"{self.role} worker {worker_id} did not start within {timeout:g} s "
                                             f"(health.start_timeout_s): {placement(actor, spec)[1]}")
                await asyncio.wait([started], timeout=step)
                waited += step
                if not started.done():
                    waiting, where = placement(actor, spec)  # a model loading is news, room lacking a warning
                    logger.log(logging.WARNING if waiting else logging.INFO, "%s worker %s not started after "
                               "%.0f s: %s", self.role, worker_id, waited, where)
            return actor, started.result()
        except BaseException:
            started.cancel()
            ray.kill(actor, no_restart=True)
            raise

    async def check(self) -> None:
        """Ping every worker; a dead or stuck one is reported, killed and replaced."""
        workers = list(self.workers)
        verdicts = await asyncio.gather(*(self._verdict(w) for w in workers))
        for worker, reason in zip(workers, verdicts):
            if reason is not None and worker.state.healthy:
                await self.replace(worker, reason)

    async def _verdict(self, worker: Worker) -> str | None:
        """Why `worker` must go, or None."""
        beat: Heartbeat | None
        try:
            beat = await asyncio.wait_for(worker.actor.ping.options(concurrency_group=HEALTH_GROUP).remote(),
                                          self.health.ping_timeout_s)
        except ACTOR_LOST as e:
            return f"Ray reports it lost ({type(e).__name__})"
        except asyncio.TimeoutError:
            beat = None
        return worker.health.observe(beat, time.monotonic())

    async def replace(self, worker: Worker, reason: str = "a call found it lost") -> None:
        if not worker.state.healthy:
            return
        worker.state.healthy = False
        if worker.phase is not Phase.SERVING:  # it was leaving: its requests move, nobody takes its place
            logger.warning("%s worker %s is lost while draining (%s)", self.role, worker.worker_id, reason)
            if self.on_lost is not None:
                await self.on_lost(worker)
            await self.remove(worker)
            return
        logger.warning("%s worker %s is lost (%s); replacing it", self.role, worker.worker_id, reason)
        self.replacing += 1
        try:
            if self.on_lost is not None:
                await self.on_lost(worker)
            ray.kill(worker.actor, no_restart=True)
            try:
                fresh = await self._spawn(worker.slot)  # in its slot: it finds the disk tier it left
            except Exception:
                logger.exception("could not replace %s worker %s", self.role, worker.worker_id)
                return
            self.workers[self.workers.index(worker)] = fresh
            worker.phase = Phase.GONE
            self.gone.append(worker)
            self.num_replaced += 1
        finally:
            self.replacing -= 1

    async def stop(self) -> None:
        for w in self.workers:
            await self._stop_actor(w)

    async def _stop_actor(self, worker: Worker) -> None:
        try:
            await asyncio.wait_for(worker.actor.shutdown.remote(), self.health.ping_timeout_s)
        except Exception:  # noqa: BLE001 - best effort, the actor is killed next
            pass
        ray.kill(worker.actor, no_restart=True)


async def start_pools(pools: list[Pool]) -> None:
    """Start every pool at once; if one fails (or the start is cancelled), the others stop
    too, their started workers killed, before the error is raised: nothing is left running."""
    starting = [asyncio.ensure_future(p.start()) for p in pools]
    try:
        await asyncio.gather(*starting)
    except BaseException:
        for task in starting:
            task.cancel()
        await asyncio.gather(*starting, return_exceptions=True)
        raise


async def _result(ref: Any) -> Any:
    return await ref


def placement(actor: Any, spec: ActorSpec) -> tuple[bool, str]:
    """Where a worker's actor stands, for an operator waiting on it: (waiting for room, the
    words): placed and starting (its model loading), or waiting for room, with what it needs and
    what the cluster has."""
    need = {"CPU": spec.num_cpus, "GPU": spec.num_gpus, **({spec.resource: 1} if spec.resource else {})}
    need = {name: amount for name, amount in need.items() if amount > 0}
    wants = ", ".join(f"{amount:g} {name}" for name, amount in need.items()) or "no resources"
    try:
        total, free = ray.cluster_resources(), ray.available_resources()
        placed = _placed(actor)
    except Exception as e:  # noqa: BLE001 - a report, never a reason to fail the start
        return True, f"it needs {wants} (the cluster's resources could not be read: {e})"
    if placed:
        return False, f"it is placed (it needs {wants}) and still starting: loading its model"
    has = ", ".join(f"{total.get(name, 0):g} {name} ({free.get(name, 0):g} free)" for name in need) or "-"
    return True, (f"it is waiting for room: it needs {wants}; the cluster has {has}. It starts once a node "
                  f"with room joins (Ray's autoscaler) or workers leave; on one machine, ask for fewer workers "
                  f"(--num-prefill, --num-decode) or give Ray more slots (RAY_OVERRIDE_RESOURCES='{{\"CPU\": 8}}')")


def _placed(actor: Any) -> bool:
    """Whether Ray has given the actor a process yet (its creation leased a worker). Ray's GCS
    actor table says so by a pid; the public state API would need the dashboard, which local
    clusters here run without."""
    from ray._private import state

    info = state.actors(actor._actor_id.hex())
    return bool(info and info.get("Pid"))
