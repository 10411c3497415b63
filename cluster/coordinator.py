"""Runs requests across the pools: route, prefill, hand KV over, stream decode tokens.

One poller per decode worker long-polls its batched token deltas and fans them
out to per-request queues. A disaggregated request waits here for a running seat on a
decode worker (the service admits no more than `capacity()`: seats plus a bounded queue
per worker); a colocated one queues in its worker's scheduler. Every request's cleanup (abort on the workers that
hold it) runs in one `finally`, whether it finished, was cancelled by the
client, hit its deadline or lost a worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import ray

from pdserve.cluster.config import CoordinatorConfig
from pdserve.cluster.metrics import Metrics
from pdserve.cluster.pools import ACTOR_LOST, Pool, Worker
from pdserve.cluster.router import LeastLoad, RoutingPolicy
from pdserve.engine.block_hash import prefix_block_hashes
from pdserve.engine.engine import NoCapacity
from pdserve.engine.messages import WorkerRequest
from pdserve.engine.outputs import TokenDelta
from pdserve.kv_transport import TransferError

logger = logging.getLogger(__name__)



class WorkerUnavailable(Exception):
    """No healthy worker could take the request, or its worker was lost mid-request."""


class Overloaded(Exception):
    """Every worker is full: the caller should back off (RESOURCE_EXHAUSTED)."""


@dataclass(slots=True)
class _Stream:
    decode: Worker
    queue: asyncio.Queue[TokenDelta | Exception] = field(default_factory=asyncio.Queue)


class Coordinator:
    def __init__(self, prefill: Pool | None, decode: Pool, policy: RoutingPolicy, block_size: int,
                 metrics: Metrics, seats_per_worker: int, max_waiting_per_worker: int,
                 config: CoordinatorConfig | None = None) -> None:
        self.prefill = prefill  # None: colocated, decode workers prefill themselves
        self.decode = decode
        self.policy = policy
        self.block_size = block_size
        self.metrics = metrics
        self.seats_per_worker = seats_per_worker  # the decode engines' max_num_seqs
        self.max_waiting_per_worker = max_waiting_per_worker
        self.config = config or CoordinatorConfig()
        self._seat_freed = asyncio.Condition()
        self._decode_policy = LeastLoad()
        for pool in self.pools():
            pool.on_lost = self.on_worker_lost
        self._streams: dict[str, _Stream] = {}
        self._tasks: list[asyncio.Task] = []
        self._pollers: dict[str, asyncio.Task] = {}

    @property
    def mode(self) -> str:
        return "colocated" if self.prefill is None else "disaggregated"

    def pools(self) -> list[Pool]:
        return [p for p in (self.prefill, self.decode) if p is not None]

    async def start(self, health_interval_s: float) -> None:
        await asyncio.gather(*(p.start() for p in self.pools()))
        for w in self.decode.workers:
            self._start_poller(w)
        self._tasks = [asyncio.create_task(self._health_loop(health_interval_s)),
                       asyncio.create_task(self._load_loop())]

    async def stop(self) -> None:
        for t in [*self._tasks, *self._pollers.values()]:
            t.cancel()
        await asyncio.gather(*(p.stop() for p in self.pools()), return_exceptions=True)

    # Requests ------------------------------------------------------------

    def capacity(self) -> int:
        """Requests the pools take at once: per healthy decode worker, its running seats
        and a bounded queue of requests waiting for one."""
        return len(self.decode.healthy()) * (self.seats_per_worker + self.max_waiting_per_worker)

    async def generate(self, req: WorkerRequest) -> AsyncIterator[TokenDelta]:
        """Yields the request's token deltas; the last one has a finish reason.

        Raises WorkerUnavailable, Overloaded or ValueError. Closing the
        iterator early (client cancel, deadline) aborts the request everywhere.
        """
        rid = req.request_id
        hashes = prefix_block_hashes(req.prompt_token_ids, self.block_size)
        if self.prefill is None:
            decode = self._pick(self.decode, [], self._decode_policy)
        else:
            decode = await self._take_seat()
        stream = self._streams[rid] = _Stream(decode)
        decode.state.inflight += 1  # no await since the choice: the seat is ours
        finished = False
        try:
            if self.prefill is None:
                try:
                    await decode.actor.submit.remote(req)
                except ACTOR_LOST as e:
                    await self.decode.replace(decode)
                    raise WorkerUnavailable(f"worker {decode.worker_id} was lost") from e
            else:
                first = await self._prefill(req, decode, hashes)
                if first is not None:
                    finished = first.finished
                    yield first
                    if finished:
                        return
            while True:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            decode.state.inflight -= 1
            del self._streams[rid]
            if not finished and decode.state.healthy:
                asyncio.ensure_future(self._abort(decode, rid))
            async with self._seat_freed:
                self._seat_freed.notify()

    async def _take_seat(self) -> Worker:
        """A decode worker with a free running seat; waits for one (in arrival order). The
        wait re-checks now and then, so that a replaced worker's seats are found too."""
        async with self._seat_freed:
            while True:
                healthy = self.decode.healthy()
                if not healthy:
                    raise WorkerUnavailable("no healthy decode worker")
                free = [w for w in healthy if w.state.inflight < self.seats_per_worker]
                if free:
                    state = self._decode_policy.choose([w.state for w in free], [])
                    return next(w for w in free if w.state is state)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._seat_freed.wait(), self.config.seat_recheck_s)

    async def _prefill(self, req: WorkerRequest, decode: Worker, hashes: list[int]) -> TokenDelta | None:
        """Reserve on `decode` and prefill elsewhere at once, hand the KV over; returns the
        first token's delta. The receiver holds KV that arrives before its reservation, so
        the reservation (a call that waits for the decode engine's current step) is not on
        the first token's path; a refused one cancels the prefill."""
        prefill = self._pick(self.prefill, hashes, self.policy)
        prefill.state.inflight += 1
        ref = prefill.actor.prefill.remote(req, decode.address)
        try:
            await self._reserve(req, decode)
        except BaseException:
            ray.cancel(ref)  # the worker aborts the request and frees its blocks
            prefill.state.inflight -= 1
            raise
        try:
            out = await ref
        except asyncio.CancelledError:
            ray.cancel(ref)
            raise
        except ACTOR_LOST as e:
            await self.prefill.replace(prefill)
            raise WorkerUnavailable(f"prefill worker {prefill.worker_id} was lost") from e
        except TransferError as e:
            raise WorkerUnavailable(f"KV transfer to {decode.worker_id} failed: {e}") from e
        finally:
            prefill.state.inflight -= 1
        if out.transfer is not None:
            self.metrics.kv_transfer(out.transfer)
        if not out.needs_decode:  # the first token ended it: give the reservation back
            await self._abort(decode, req.request_id)
            return out.first
        try:
            await decode.actor.admit.remote(req.request_id, out.first.token_ids[0])
        except TransferError as e:
            raise WorkerUnavailable(f"KV transfer to {decode.worker_id} failed: {e}") from e
        except ACTOR_LOST as e:
            await self.decode.replace(decode)
            raise WorkerUnavailable(f"decode worker {decode.worker_id} was lost") from e
        return out.first

    async def _reserve(self, req: WorkerRequest, decode: Worker) -> None:
        try:
            await decode.actor.reserve.remote(req)
        except NoCapacity as e:
            raise Overloaded(str(e)) from e
        except ACTOR_LOST as e:
            await self.decode.replace(decode)
            raise WorkerUnavailable(f"decode worker {decode.worker_id} was lost") from e

    def _pick(self, pool: Pool, hashes: list[int], policy: RoutingPolicy) -> Worker:
        healthy = pool.healthy()
        if not healthy:
            raise WorkerUnavailable(f"no healthy {pool.role} worker")
        state = policy.choose([w.state for w in healthy], hashes)
        return next(w for w in healthy if w.state is state)

    async def _abort(self, worker: Worker, request_id: str) -> None:
        try:
            await asyncio.wait_for(worker.actor.abort.remote(request_id), self.config.abort_timeout_s)
        except Exception:  # noqa: BLE001 - a lost worker is handled by the health loop
            logger.warning("abort of %s on %s failed", request_id, worker.worker_id)

    # Background ----------------------------------------------------------

    def _start_poller(self, worker: Worker) -> None:
        self._pollers[worker.worker_id] = asyncio.create_task(self._poll(worker))

    async def _poll(self, worker: Worker) -> None:
        while worker.state.healthy:
            try:
                deltas = await worker.actor.poll.remote(self.config.poll_wait_s)
            except ACTOR_LOST:
                await self.decode.replace(worker)
                return
            for delta in deltas:
                stream = self._streams.get(delta.request_id)
                if stream is not None:
                    stream.queue.put_nowait(delta)

    async def on_worker_lost(self, worker: Worker) -> None:
        """Fail the requests a lost worker held (their callers see UNAVAILABLE)."""
        self._pollers.pop(worker.worker_id, None)
        for rid, stream in self._streams.items():
            if stream.decode is worker:
                stream.queue.put_nowait(WorkerUnavailable(f"{worker.role} worker {worker.worker_id} was lost"))
        self.metrics.worker_lost(worker.role)

    async def _health_loop(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            for pool in self.pools():
                await pool.check()
            for w in self.decode.workers:
                if w.state.healthy and w.worker_id not in self._pollers:
                    self._start_poller(w)

    async def _load_loop(self) -> None:
        while True:
            workers = [w for p in self.pools() for w in p.healthy()]
            loads = await asyncio.gather(*(w.actor.load.remote() for w in workers), return_exceptions=True)
            for w, load in zip(workers, loads):
                if not isinstance(load, BaseException):
                    w.state.load = load
                    self.metrics.worker_load(w.role, w.worker_id, load)
            await asyncio.sleep(self.config.load_refresh_s)
