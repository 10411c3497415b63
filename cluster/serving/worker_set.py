"""The cluster's worker set and its one owner: the prefill and decode pools, the decode workers'
token streams, the decode seats and the KV index, the loops that keep them current (health
checks; load reads and the KV events they carry), and the one path by which a worker leaves,
lost or drained (`WorkerSet._leaves`).

A seam: the coordinator, the elastic admin, the planner and the APIs speak to it through its
methods, never through its parts. The admin and planner side takes worker ids and roles and
answers in small frozen messages (`WorkerInfo`, `RoleSummary`, `EngineLoad`), so that it can
move behind remote calls into a control-plane process of its own (the frontends issue). The
request side (`place`, `take_decode_seat`, `open_stream`, `close_stream`, `lost`) hands an
attempt a `Seat`: the worker's actor handle and KV address, which Ray can send anywhere, and
the seat's bookkeeping, which stays where the seats are kept.

One writer (the server's event loop), no locks.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from pdserve.cluster.serving.errors import WorkerLost, WorkerUnavailable, cause
from pdserve.cluster.serving.kv_index import KVIndex
from pdserve.cluster.serving.metrics import Metrics
from pdserve.cluster.serving.pools import Member, Phase, Pool, Worker, start_pools
from pdserve.cluster.serving.router import PromptBlocks, make_policy
from pdserve.cluster.serving.seats import Seat, SeatLine, may_wait
from pdserve.cluster.serving.token_streams import StreamQueue, TokenStreams
from pdserve.cluster.settings.config import CoordinatorConfig, RouterConfig
from pdserve.cluster.settings.tenants import DEFAULT_TENANT, Tenant
from pdserve.engine.outputs import EngineLoad

logger = logging.getLogger(__name__)


class UnknownWorker(LookupError):
    """No worker of that name (NOT_FOUND)."""


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """One worker as the admin API and the server's info list it."""

    worker_id: str
    role: str
    phase: Phase
    num_running: int  # sequences its engine runs (its last load)
    num_queued: int  # sequences waiting in its engine, or for their KV to land
    num_inflight: int  # requests the coordinator placed on it that have not ended
    healthy: bool = True  # False: lost (being replaced) or gone
    load: EngineLoad | None = None  # its last load, None before the first or once gone

    @classmethod
    def of(cls, worker: Worker) -> WorkerInfo:
        load = worker.state.load
        healthy = worker.state.healthy
        if load is None or worker.phase is Phase.GONE:
            return cls(worker.worker_id, worker.role, worker.phase, 0, 0, 0, healthy)
        return cls(worker.worker_id, worker.role, worker.phase, load.num_running,
                   load.num_waiting + load.num_receiving, worker.state.inflight, healthy, load)


@dataclass(frozen=True, slots=True)
class RoleSummary:
    """What a role's workers hold now: whether one of them may leave."""

    num_serving: int  # healthy and not draining
    num_inflight: int  # requests placed on its live workers, draining ones included
    num_queued: int  # requests waiting for a seat of this role (decode only)


class WorkerSet:
    def __init__(self, prefill: Pool | None, decode: Pool, routing: str, block_size: int, metrics: Metrics,
                 seats_per_worker: int, max_waiting_per_worker: int, config: CoordinatorConfig | None = None,
                 router: RouterConfig | None = None, reader: str = "", preempt_seats: bool = False,
                 lease_renew_s: float = 0.0, places_requests: bool = True) -> None:
        self.prefill = prefill  # None: colocated, decode workers prefill themselves
        self.decode = decode
        self.metrics = metrics
        self.config = config = config or CoordinatorConfig()
        # What every worker's prefix cache holds, from the KV events their load reports carry.
        self.kv_index = KVIndex()
        self.policy = make_policy(routing, self.kv_index, router)  # `routing` places prefills
        self.decode_policy = make_policy("prefix_aware" if routing == "prefix_aware" else "least_load",
                                         self.kv_index, router)
        # preempt_seats: the decode engines preempt by priority (`SeatLine.preempt`).
        self.seats = SeatLine(decode, self.decode_policy, block_size, seats_per_worker, max_waiting_per_worker, config,
                              preempt_seats)
        # Whose view this is: a frontend's id (its streams and KV-event cursor on the workers), or
        # the control plane's; "" for a single server's.
        self.reader = reader
        # places_requests: False for the control plane's view, which places none: it polls no
        # decode worker's deltas (a long poll of an empty outbox per worker, for nothing).
        self.places_requests = places_requests
        # A named frontend renews its lease on the prefill workers this often (0: no lease:
        # a single server's, or the control plane's); its decode workers' lease rides on its polls.
        self.lease_renew_s = lease_renew_s
        self.streams = TokenStreams(decode, config.poll_wait_s, reader)
        for pool in self.pools():
            pool.on_lost = self._lost
        self._tasks: list[asyncio.Task] = []

    @property
    def mode(self) -> str:
        return "colocated" if self.prefill is None else "disaggregated"

    def pools(self) -> list[Pool]:
        """The pools themselves: for this owner's own loops (and tests), never across the seam."""
        return [p for p in (self.prefill, self.decode) if p is not None]

    async def start(self, health_interval_s: float) -> None:
        await start_pools(self.pools())  # all or none: a failed start leaves no worker running
        self._follow_streams()
        self._tasks = [asyncio.create_task(self._health_loop(health_interval_s)),
                       asyncio.create_task(self._load_loop())]
        if self.lease_renew_s and self.reader and self.prefill is not None:
            self._tasks.append(asyncio.create_task(self._lease_loop()))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        self.streams.stop()
        await asyncio.gather(*(p.stop() for p in self.pools()), return_exceptions=True)

    async def max_model_len(self) -> int:
        """The longest context every worker takes (workers may cap it below the model's: their KV pool)."""
        return min([await w.actor.max_model_len.remote() for p in self.pools() for w in p.workers])

    # The request path ----------------------------------------------------

    def capacity(self) -> int:
        """Requests the pools take at once (`SeatLine.capacity`): what the frontends admit."""
        return self.seats.capacity()

    def num_queued(self) -> int:
        """Requests waiting for a decode seat now."""
        return self.seats.num_queued

    async def place(self, request_id: str, prompt: PromptBlocks, migrated: bool, give_up: float,
                    prefill: bool) -> Seat:
        """A seat for `request_id` on a serving prefill worker (`prefill`) or, colocated, decode
        worker (where it queues in the worker's scheduler), chosen for `prompt` by the pool's
        policy; finding none, it waits while `may_wait`, then WorkerUnavailable."""
        pool, policy = (self.prefill, self.policy) if prefill else (self.decode, self.decode_policy)
        if pool is None:
            raise ValueError("a colocated worker set has no prefill pool: its decode workers prefill")
        while not pool.serving() and may_wait(pool, migrated, give_up):
            await asyncio.sleep(self.config.seat_recheck_s)
        serving = pool.serving()
        if not serving:
            raise WorkerUnavailable(f"no healthy {pool.role} worker")
        state = policy.choose([w.state for w in serving], prompt)
        worker = next(w for w in serving if w.state is state)
        self.seats.seat(worker, request_id)
        return Seat(worker, request_id, self.seats)

    async def take_decode_seat(self, request_id: str, num_prompt_tokens: int, front: bool, migrated: bool,
                               give_up: float, prompt: PromptBlocks, priority: int = 0,
                               tenant: Tenant = DEFAULT_TENANT) -> Seat:
        """A decode seat with a claim on the blocks of the prompt's KV (`SeatLine.take`), in
        `priority` order and, within one, by `tenant`'s weighted share of the seats."""
        need = self.seats.kv_need(num_prompt_tokens)
        worker = await self.seats.take(request_id, need, front, migrated, give_up, prompt, priority, tenant)
        return Seat(worker, request_id, self.seats)

    def open_stream(self, seat: Seat) -> StreamQueue:
        """The queue of the seat's request's deltas from its decode worker (followed now if it is
        a replacement the health loop has not seen yet)."""
        self.streams.follow(seat.worker)
        return self.streams.open(seat.request_id, seat.worker)

    def close_stream(self, request_id: str) -> None:
        self.streams.close(request_id)

    async def lost(self, worker: Worker) -> None:
        """A call found `worker` lost: its pool replaces it (`Pool.replace`)."""
        await self._pool(worker.role).replace(worker)

    # The admin and planner side: ids and roles in, small messages out ----

    def roles(self) -> tuple[str, ...]:
        return tuple(p.role for p in self.pools())

    def workers(self, gone: bool = True) -> list[WorkerInfo]:
        """Every worker of every pool, live ones first, then (`gone`) the recently gone."""
        live = [WorkerInfo.of(w) for p in self.pools() for w in p.workers]
        return live + [WorkerInfo.of(w) for p in self.pools() for w in p.gone] if gone else live

    def members(self) -> list[Member]:
        """The live workers with their actor handles, as a control plane publishes them."""
        return [Member.of(w) for p in self.pools() for w in p.workers]

    async def check(self) -> None:
        """Ping every worker now (a frontend reported one lost): a dead one is replaced."""
        for pool in self.pools():
            await pool.check()

    def find(self, worker_id: str) -> WorkerInfo | None:
        """The worker of that id, live or gone (None: no such worker)."""
        worker = self._find(worker_id)
        return None if worker is None else WorkerInfo.of(worker)

    def least_busy(self, role: str) -> str | None:
        """The serving worker of `role` with the fewest requests (None: it has none)."""
        serving = self._pool(role).serving()
        return min(serving, key=lambda w: w.state.inflight).worker_id if serving else None

    def summary(self, role: str) -> RoleSummary:
        pool = self._pool(role)
        num_queued = self.seats.num_queued if pool is self.decode else 0
        return RoleSummary(len(pool.serving()), sum(w.state.inflight for w in pool.workers), num_queued)

    def serving_loads(self, role: str) -> list[EngineLoad | None]:
        """The last loads of `role`'s serving workers (None: not read yet), one per worker."""
        return [w.state.load for w in self._pool(role).serving()]

    def unserved_roles(self) -> list[str]:
        """The roles with no serving worker (all lost or draining): no request can run."""
        return [p.role for p in self.pools() if not p.serving()]

    def cached_blocks(self, worker_id: str) -> dict[str, int]:
        """A worker's cached blocks per tier, as the KV index knows them."""
        return self.kv_index.blocks_of(worker_id)

    def num_placed(self, worker_id: str) -> int:
        """Requests placed on a live worker that have not let go of it (0: lost or gone): this
        owner's placements, and the sequences its last load showed (other frontends' too)."""
        worker = self._worker(worker_id)
        if not worker.state.healthy:
            return 0
        load = worker.state.load
        shown = 0 if load is None else load.num_running + load.num_waiting + load.num_receiving + load.num_held
        return max(worker.state.inflight, shown if self.reader else 0)

    async def add(self, role: str) -> WorkerInfo:
        """One more worker of `role`, started as the pool's first ones were (bounded by
        `health.start_timeout_s`); it takes requests once it answers."""
        pool = self._pool(role)
        worker = await pool.add()
        if pool is self.decode:
            self._follow_streams()
            self.seats.wake()  # a request waiting for a seat may take one there
        return WorkerInfo.of(worker)

    def drain(self, worker_id: str) -> None:
        """The worker takes no new request from now on (`Pool.drain`)."""
        worker = self._worker(worker_id)
        self._pool(worker.role).drain(worker)

    def move_requests(self, worker_id: str, reason: str) -> bool:
        """End the streams of a decode worker's requests with WorkerLost(`reason`) behind the
        deltas already queued: their coordinators continue them elsewhere. False for a prefill
        worker: its calls in flight fail as it stops, and are retried elsewhere."""
        worker = self._worker(worker_id)
        if worker.role != self.decode.role:
            return False
        self.streams.move(worker, WorkerLost(reason))
        return True

    async def remove(self, worker_id: str) -> None:
        """The worker leaves: its actor stops (`Pool.remove`) and it leaves the set (`_leaves`).
        The caller has let its requests finish or move."""
        worker = self._worker(worker_id)
        await self._pool(worker.role).remove(worker)
        await self._leaves(worker, lost=False)

    # Leaving ---------------------------------------------------------------

    async def _lost(self, worker: Worker) -> None:
        """A pool found `worker` lost (before its replacement starts)."""
        await self._leaves(worker, lost=True)

    async def _leaves(self, worker: Worker, lost: bool) -> None:
        """The one path of a worker leaving the set, lost or drained and stopped: its cached
        blocks leave the KV index at once (they route no one now); the requests still streaming
        from it end with WorkerLost (their callers continue them elsewhere, or see UNAVAILABLE);
        its poller stops; its metrics series go (and a lost one is counted)."""
        self.kv_index.remove_worker(worker.worker_id)
        self.streams.leave(worker, WorkerLost(f"{worker.role} worker {worker.worker_id} "
                                              f"{'was lost' if lost else 'left'}"))
        if lost:
            self.metrics.worker_lost(worker.role, worker.worker_id)
        else:
            self.metrics.worker_left(worker.role, worker.worker_id)

    # Lookups ----------------------------------------------------------------

    def _pool(self, role: str) -> Pool:
        for pool in self.pools():
            if pool.role == role:
                return pool
        raise ValueError(f"role must be one of {', '.join(self.roles())} on this {self.mode} server, got {role!r}")

    def _find(self, worker_id: str) -> Worker | None:
        for pool in self.pools():
            worker = pool.find(worker_id)
            if worker is not None:
                return worker
        return None

    def _worker(self, worker_id: str) -> Worker:
        worker = self._find(worker_id)
        if worker is None:
            raise UnknownWorker(f"no worker {worker_id!r} (pdserve workers lists them)")
        return worker

    # Background ----------------------------------------------------------

    async def _health_loop(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            for pool in self.pools():
                await pool.check()
            self._follow_streams()

    def _follow_streams(self) -> None:
        if self.places_requests:
            for w in self.decode.workers:
                if w.state.healthy:
                    self.streams.follow(w)

    async def _lease_loop(self) -> None:
        """Renew this frontend's lease on every prefill worker, each call on its own (bounded by
        the period: a worker that does not answer delays no other's renewal)."""
        assert self.prefill is not None
        while True:
            calls = [w.actor.renew_lease.remote(self.reader) for w in self.prefill.healthy()]
            if calls:
                await asyncio.wait([asyncio.ensure_future(c) for c in calls], timeout=self.lease_renew_s)
            await asyncio.sleep(self.lease_renew_s)

    async def _load_loop(self) -> None:
        while True:
            workers = [w for p in self.pools() for w in p.healthy()]
            asked = asyncio.get_running_loop().time()
            loads = await asyncio.gather(*((w.actor.load.remote(self.reader) if self.reader else w.actor.load.remote())
                                           for w in workers), return_exceptions=True)
            reported = [(w, load) for w, load in zip(workers, loads)
                        if not isinstance(load, BaseException) and w.state.healthy]  # not lost meanwhile
            for w, load in reported:
                w.state.load, w.state.load_asked_at = load, asked
                self.metrics.worker_load(w.role, w.worker_id, load)
            self.seats.wake()  # blocks freed since the last load show now
            await self._index_events(reported)
            await asyncio.sleep(self.config.load_refresh_s)

    async def _index_events(self, reported: list[tuple[Worker, EngineLoad]]) -> None:
        """Apply the KV events the loads carried; resync a worker that is out of sync (a gap,
        a restart) from its snapshot before its next load is read, so that no events are
        taken from it meanwhile and the replay from the snapshot's number misses none."""
        index = self.kv_index
        stale = [w for w, load in reported if load.kv_events is not None
                 and not index.apply(w.worker_id, load.kv_events)]
        snapshots = await asyncio.gather(*(w.actor.kv_snapshot.remote() for w in stale), return_exceptions=True)
        for w, snapshot in zip(stale, snapshots):
            if isinstance(snapshot, BaseException):
                logger.warning("KV snapshot of %s failed: %s", w.worker_id, cause(snapshot))
            elif w.state.healthy:
                index.resync(w.worker_id, snapshot)
        self.metrics.kv_index(index, [(w.role, w.worker_id) for w, _ in reported])
