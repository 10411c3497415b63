"""Runs requests across the pools: route, prefill, hand KV over, stream decode tokens.

Three jobs, three owners: the line for decode seats (`seats.SeatLine`: seats, KV claims, the
queue), the token streams (`token_streams.TokenStreams`: one poller per decode worker fanning
its deltas out to the requests' queues) and, here, each request's attempts. Every request's
cleanup (abort on the workers that hold it) runs in one `finally`, whether it finished, was
cancelled by the client, hit its deadline or lost a worker; its seat and KV claim are freed
once its abort has been. A request whose worker is lost continues on
another (`generate`: re-prefill of its prompt plus the tokens streamed so far).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import ray

from pdserve.cluster.serving.errors import Overloaded, TransportRefused, WorkerLost, WorkerUnavailable, cause
from pdserve.cluster.serving.kv_index import KVIndex
from pdserve.cluster.serving.metrics import Metrics
from pdserve.cluster.serving.pools import ACTOR_LOST, Pool, Worker
from pdserve.cluster.serving.router import PromptBlocks, RoutingPolicy, make_policy
from pdserve.cluster.serving.seats import SeatLine, may_wait
from pdserve.cluster.serving.token_streams import TokenStreams
from pdserve.cluster.settings.config import CoordinatorConfig, RouterConfig
from pdserve.engine.kv_handoff import NoCapacity
from pdserve.engine.messages import KVTransferInfo, WorkerRequest
from pdserve.engine.outputs import EngineLoad, TokenDelta
from pdserve.kv_transport import HandshakeRefused, SlowPathRefused, TransferError

logger = logging.getLogger(__name__)



class _NoRoom(Exception):
    """The decode worker refused a reservation that the coordinator's budget allowed (the
    blocks of a request that just ended were not freed yet): the request takes a seat again."""


def _continuation(req: WorkerRequest, generated: list[int], attempt: int) -> WorkerRequest:
    """`req` from where its stream stands: the tokens streamed so far join the prompt and
    leave the budget (and count as its output for sampling: a seeded request goes on as
    it would have). A fresh id per attempt, so that nothing of an earlier one (a late
    delta, a transfer, an abort) can touch it. The prompt's log-probabilities came with the
    first token: once that is streamed, they are not asked for again."""
    remaining = req.params.max_tokens - len(generated)
    if remaining < 1:
        raise WorkerUnavailable(f"request {req.request_id}: nothing left to generate after a lost worker")
    prompt_logprobs = None if generated else req.params.prompt_logprobs
    return WorkerRequest(f"{req.request_id}~{attempt}", (*req.prompt_token_ids, *generated),
                         dataclasses.replace(req.params, max_tokens=remaining, prompt_logprobs=prompt_logprobs),
                         req.num_prior_output_tokens + len(generated))


def _transfer_failed(decode: Worker, error: TransferError) -> WorkerUnavailable:
    """A refused handshake or slow path is the cluster's configuration: trying again will not
    help. Any other failure (a peer lost or replaced, a timeout) may go better elsewhere.

    `error` raised in a worker comes wrapped by Ray, its text the actor's traceback: the
    message keeps the original's own one line; the log has the rest."""
    logger.warning("KV transfer to %s failed", decode.worker_id, exc_info=error)
    message = f"KV transfer to {decode.worker_id} failed: {cause(error)}"
    if isinstance(error, SlowPathRefused):
        return TransportRefused(f"{message} (kv_transport.require / allowed_transports)")
    if isinstance(error, HandshakeRefused):
        return TransportRefused(message)
    return WorkerLost(message)


# Where a request's first token spends its time, hop by hop (RequestReport.hops), in path order.
# Disaggregated: a decode seat and a prefill worker chosen; the prefill worker's engine takes the
# request (after its current step), computes the prompt and samples; the rest of the KV send; the
# prefill call's Ray dispatch and return (and a reservation that outlasted the prefill). The
# decode worker's admission follows the first token, off its path.
# Colocated: the worker chosen; the submit call; the engine's queue, compute and the poll that
# brings the first token back. "other" (the frontend's own, filled in there): everything else
# from the request's arrival, so that the hops add up to its TTFT.
DISAGGREGATED_HOPS = ("seat", "prefill_queue", "prefill_compute", "kv_wait", "prefill_rpc")
COLOCATED_HOPS = ("seat", "submit", "first_delta")


@dataclass(slots=True)
class RequestReport:
    """What a request's run tells besides its tokens, filled in as it goes: a frontend puts it
    in the request's last response."""

    # How its KV moved from prefill to decode worker, one per attempt that moved any (a
    # migrated request has several; a colocated one, or one that ended at its first token, none).
    transfers: list[KVTransferInfo] = field(default_factory=list)
    # Seconds of its first token per hop (DISAGGREGATED_HOPS or COLOCATED_HOPS), of the attempt
    # that produced it. Beside the path: "reserve", the decode worker's reservation (it runs
    # alongside the prefill).
    hops: dict[str, float] = field(default_factory=dict)


class Coordinator:
    def __init__(self, prefill: Pool | None, decode: Pool, routing: str, block_size: int,
                 metrics: Metrics, seats_per_worker: int, max_waiting_per_worker: int,
                 config: CoordinatorConfig | None = None, router: RouterConfig | None = None) -> None:
        self.prefill = prefill  # None: colocated, decode workers prefill themselves
        self.decode = decode
        self.block_size = block_size
        self.metrics = metrics
        self.config = config = config or CoordinatorConfig()
        # What every worker's prefix cache holds, from the KV events their load reports carry.
        self.kv_index = KVIndex()
        self.policy = make_policy(routing, self.kv_index, router)  # `routing` places prefills
        self._decode_policy = make_policy("prefix_aware" if routing == "prefix_aware" else "least_load",
                                          self.kv_index, router)
        self.seats = SeatLine(decode, self._decode_policy, block_size, seats_per_worker, max_waiting_per_worker, config)
        self.streams = TokenStreams(decode, config.poll_wait_s)
        for pool in self.pools():
            pool.on_lost = self.on_worker_lost
        self._tasks: list[asyncio.Task] = []
        # Aborts that free a seat when done: held here, since the loop keeps only weak references.
        self._aborting: set[asyncio.Task] = set()

    @property
    def mode(self) -> str:
        return "colocated" if self.prefill is None else "disaggregated"

    def pools(self) -> list[Pool]:
        return [p for p in (self.prefill, self.decode) if p is not None]

    async def start(self, health_interval_s: float) -> None:
        await asyncio.gather(*(p.start() for p in self.pools()))
        for w in self.decode.workers:
            self.streams.follow(w)
        self._tasks = [asyncio.create_task(self._health_loop(health_interval_s)),
                       asyncio.create_task(self._load_loop())]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        self.streams.stop()
        await asyncio.gather(*(p.stop() for p in self.pools()), return_exceptions=True)

    # Requests ------------------------------------------------------------

    def capacity(self) -> int:
        """Requests the pools take at once (`SeatLine.capacity`): what the frontends admit."""
        return self.seats.capacity()

    async def generate(self, req: WorkerRequest, report: RequestReport | None = None) -> AsyncIterator[TokenDelta]:
        """Yields the request's token deltas; the last one has a finish reason.

        A request whose worker is lost (decode worker mid-stream, prefill worker, or its KV
        transfer) continues on another (or the lost one's replacement): its prompt plus the
        tokens already streamed are prefilled again (the prefill worker's prefix cache holds
        the prompt's blocks where it still can) and decoding goes on from there, so the
        caller's stream neither repeats nor drops a token; greedy output is the same as an
        undisturbed run's. At most `config.max_migrations` times, then WorkerUnavailable.

        `report`, if given, is filled in as the request runs (its KV transfers).

        Raises WorkerUnavailable (TransportRefused: the pair's KV transport is refused),
        Overloaded or ValueError. Closing the iterator early (client cancel, deadline) aborts
        the request everywhere.
        """
        generated: list[int] = []
        num_lost = num_refused = 0
        # The prompt tokens the request's prefill took from cache, as its first delta says
        # (disaggregated: the prefill worker's; the decode worker's deltas count the KV it was
        # sent as not cached), for all its deltas and continuations.
        num_cached: int | None = None
        for attempt in itertools.count():
            run = req if attempt == 0 else _continuation(req, generated, attempt)
            try:
                # aclosing: a caller that stops early ends the attempt (and its cleanup) at once.
                async with contextlib.aclosing(self._run(run, num_lost > 0, attempt > 0, report)) as deltas:
                    async for delta in deltas:
                        if num_cached is None:
                            num_cached = delta.num_cached_tokens
                        if attempt or delta.num_cached_tokens != num_cached:
                            # the caller knows one request: its id, its prompt, its prefill
                            delta = dataclasses.replace(delta, request_id=req.request_id, num_cached_tokens=num_cached,
                                                        num_prompt_tokens=len(req.prompt_token_ids))
                        generated.extend(delta.token_ids)
                        yield delta
                return
            except _NoRoom as e:
                num_refused += 1
                if num_refused > self.config.reserve_retries:
                    raise Overloaded(str(e)) from e
                await asyncio.sleep(self.config.load_refresh_s)  # the worker frees them within a step
            except WorkerLost as e:
                num_lost += 1
                if num_lost > self.config.max_migrations:
                    raise WorkerUnavailable(f"{e} (gave up after {attempt + 1} attempts)") from e
                logger.warning("request %s: %s; continuing it elsewhere after %d tokens", req.request_id, e,
                               len(generated))
                self.metrics.migrations.inc()

    async def _run(self, req: WorkerRequest, migrated: bool, retried: bool,
                   report: RequestReport | None) -> AsyncIterator[TokenDelta]:
        """One attempt at `req` on one decode worker (and one prefill worker). Finding no
        healthy worker of a role, it waits (`may_wait`) for a lost one's replacement. A
        `retried` request (one that lost its worker or its reservation) waits for a seat at
        the head of the queue."""
        rid = req.request_id
        started = time.perf_counter()
        hops: dict[str, float] = {} if report is None or migrated else report.hops
        prompt = PromptBlocks.of(req.prompt_token_ids, self.block_size, req.params.cache_salt)
        give_up = asyncio.get_running_loop().time() + self.config.migration_wait_s
        if self.prefill is None:
            decode = await self._pick_waiting(self.decode, prompt, self._decode_policy, migrated, give_up)
            self.seats.seat(decode, rid)
        else:
            need = self.seats.kv_need(len(req.prompt_token_ids))
            decode = await self.seats.take(rid, need, retried, migrated, give_up, prompt, req.params.priority)
        hops["seat"] = time.perf_counter() - started
        self.streams.follow(decode)  # a replacement: not waiting for the health loop
        queue = self.streams.open(rid, decode)
        finished = False
        admitting: asyncio.Future[None] | None = None
        try:
            if self.prefill is None:
                submitted = time.perf_counter()
                try:
                    await decode.actor.submit.remote(req)
                except ACTOR_LOST as e:
                    await self.decode.replace(decode)
                    raise WorkerLost(f"worker {decode.worker_id} was lost") from e
                hops["submit"] = time.perf_counter() - submitted
            else:
                first, admitting = await self._prefill(req, decode, prompt, migrated, give_up, report, hops)
                finished = first.finished
                yield first  # the decode worker admits the request meanwhile: not on the first token's path
                if finished:
                    return
                await admitting
            waited = time.perf_counter()
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                if "first_delta" not in hops and self.prefill is None:
                    hops["first_delta"] = time.perf_counter() - waited
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self.streams.close(rid)
            if admitting is not None and not admitting.done():
                # The abort must reach the decode worker after the admit, not overtake it.
                await asyncio.wait([admitting], timeout=self.config.abort_timeout_s)
                if admitting.done() and not admitting.cancelled() and admitting.exception() is not None:
                    logger.info("request %s: admit after its end failed: %s", rid, admitting.exception())
            if not finished and decode.state.healthy:
                # Its seat and blocks are the worker's until the abort has freed them there.
                aborting = asyncio.ensure_future(self._abort(decode, rid, free_seat=True))
                self._aborting.add(aborting)
                aborting.add_done_callback(self._aborting.discard)
            else:
                self.seats.free(decode, rid)

    async def _prefill(self, req: WorkerRequest, decode: Worker, prompt: PromptBlocks, migrated: bool,
                       give_up: float, report: RequestReport | None,
                       hops: dict[str, float]) -> tuple[TokenDelta, asyncio.Future[None] | None]:
        """Reserve on `decode` and prefill elsewhere at once, hand the KV over; returns the
        first token's delta and, unless that ended the request, its admission on `decode`
        (started, not awaited: the first token need not wait for it). The receiver holds KV
        that arrives before its reservation, so the reservation (a call that waits for the
        decode engine's current step) is not on the first token's path; a refused one
        cancels the prefill."""
        prefill = await self._pick_waiting(self.prefill, prompt, self.policy, migrated, give_up)
        self.seats.seat(prefill, req.request_id)
        try:
            called = time.perf_counter()
            ref = prefill.actor.prefill.remote(req, decode.address)
            try:
                await self._reserve(req, decode)
                hops["reserve"] = time.perf_counter() - called
            except BaseException:
                ray.cancel(ref)  # the worker aborts the request and frees its blocks
                raise
            try:
                out = await ref
            except asyncio.CancelledError:
                ray.cancel(ref)
                raise
            except ACTOR_LOST as e:
                await self.prefill.replace(prefill)
                raise WorkerLost(f"prefill worker {prefill.worker_id} was lost") from e
            except TransferError as e:
                raise _transfer_failed(decode, e) from e
        finally:
            self.seats.free(prefill, req.request_id)
        if out.times is not None:
            hops.update(prefill_queue=out.times.queue_s, prefill_compute=out.times.compute_s,
                        kv_wait=out.times.kv_wait_s, prefill_rpc=time.perf_counter() - called - out.times.total_s)
        if out.transfer is not None:
            self.metrics.kv_transfer(out.transfer)
            if report is not None:
                report.transfers.append(out.transfer)
        if not out.needs_decode:  # the first token ended it: give the reservation back
            await self._abort(decode, req.request_id)
            return out.first, None
        return out.first, asyncio.ensure_future(self._admit(decode, req.request_id, out.first.token_ids[0],
                                                            out.grammar))

    async def _admit(self, decode: Worker, request_id: str, first_token_id: int, grammar: str | None) -> None:
        try:
            await decode.actor.admit.remote(request_id, first_token_id, grammar)
        except TransferError as e:
            raise _transfer_failed(decode, e) from e
        except ACTOR_LOST as e:
            await self.decode.replace(decode)
            raise WorkerLost(f"decode worker {decode.worker_id} was lost") from e

    async def _reserve(self, req: WorkerRequest, decode: Worker) -> None:
        try:
            await decode.actor.reserve.remote(req)
            self.seats.reserved(decode, req.request_id)
        except NoCapacity as e:
            raise _NoRoom(f"decode worker {decode.worker_id}: {cause(e)}") from e
        except ACTOR_LOST as e:
            await self.decode.replace(decode)
            raise WorkerLost(f"decode worker {decode.worker_id} was lost") from e

    async def _pick_waiting(self, pool: Pool, prompt: PromptBlocks, policy: RoutingPolicy, migrated: bool,
                            give_up: float) -> Worker:
        """`_pick`, waiting for a serving worker while `may_wait`."""
        while not pool.serving() and may_wait(pool, migrated, give_up):
            await asyncio.sleep(self.config.seat_recheck_s)
        return self._pick(pool, prompt, policy)

    def _pick(self, pool: Pool, prompt: PromptBlocks, policy: RoutingPolicy) -> Worker:
        """One of `pool`'s serving workers (a draining one takes no new request)."""
        serving = pool.serving()
        if not serving:
            raise WorkerUnavailable(f"no healthy {pool.role} worker")
        state = policy.choose([w.state for w in serving], prompt)
        return next(w for w in serving if w.state is state)

    async def _abort(self, worker: Worker, request_id: str, free_seat: bool = False) -> None:
        """Abort `request_id` on `worker`; then, if `free_seat`, free its seat and claim there."""
        try:
            await asyncio.wait_for(worker.actor.abort.remote(request_id), self.config.abort_timeout_s)
        except Exception:  # noqa: BLE001 - a lost worker is handled by the health loop
            logger.warning("abort of %s on %s failed", request_id, worker.worker_id)
        finally:
            if free_seat:
                self.seats.free(worker, request_id)

    # Background ----------------------------------------------------------

    async def on_worker_lost(self, worker: Worker) -> None:
        """Fail the requests a lost worker held (their callers see UNAVAILABLE); its cached
        blocks leave the KV index at once."""
        self.kv_index.remove_worker(worker.worker_id)
        self.streams.fail(worker, WorkerLost(f"{worker.role} worker {worker.worker_id} was lost"))
        self.metrics.worker_lost(worker.role, worker.worker_id)

    async def _health_loop(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            for pool in self.pools():
                await pool.check()
            for w in self.decode.workers:
                if w.state.healthy:
                    self.streams.follow(w)

    async def _load_loop(self) -> None:
        while True:
            workers = [w for p in self.pools() for w in p.healthy()]
            asked = asyncio.get_running_loop().time()
            loads = await asyncio.gather(*(w.actor.load.remote() for w in workers), return_exceptions=True)
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
