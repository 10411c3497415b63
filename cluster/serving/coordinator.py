"""Runs requests across the pools: route, prefill, hand KV over, stream decode tokens.

The worker set (`worker_set.WorkerSet`: pools, seats, token streams, KV index) is asked for
seats and streams; here, each request's attempts. The coordinator creates and drives them
(`generate`): an `_Attempt` owns its seats for its whole life (taken, reserved, prefilled,
admitted, streamed, then freed, or aborted on the worker and freed once the abort has been), and
its cleanup runs in one `finally`, whether it finished, was cancelled by the client, hit its
deadline or lost a worker. A request whose worker is lost continues on another (a new attempt:
re-prefill of its prompt plus the tokens streamed so far).
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
from pdserve.cluster.serving.metrics import Metrics
from pdserve.cluster.serving.pools import ACTOR_LOST, Worker
from pdserve.cluster.serving.router import PromptBlocks
from pdserve.cluster.serving.seats import Seat
from pdserve.cluster.serving.token_streams import take_coalesced
from pdserve.cluster.serving.worker_set import WorkerSet
from pdserve.cluster.settings.config import CoordinatorConfig
from pdserve.cluster.settings.tenants import DEFAULT_TENANT, Tenant
from pdserve.engine.kv_handoff import NoCapacity
from pdserve.engine.messages import KVTransferInfo, WorkerRequest
from pdserve.engine.outputs import TokenDelta
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
    def __init__(self, worker_set: WorkerSet, block_size: int, metrics: Metrics,
                 config: CoordinatorConfig | None = None) -> None:
        self._workers = worker_set
        self._block_size = block_size
        self._metrics = metrics
        self._config = config or CoordinatorConfig()
        # Aborts that free a seat when done: held here, since the loop keeps only weak references.
        self._aborting: set[asyncio.Task] = set()

    @property
    def mode(self) -> str:
        return self._workers.mode

    def capacity(self) -> int:
        """Requests the pools take at once (`SeatLine.capacity`): what the frontends admit."""
        return self._workers.capacity()

    async def generate(self, req: WorkerRequest, report: RequestReport | None = None,
                       tenant: Tenant = DEFAULT_TENANT) -> AsyncIterator[TokenDelta]:
        """Yields the request's token deltas; the last one has a finish reason.

        A request whose worker is lost (decode worker mid-stream, prefill worker, or its KV
        transfer) continues on another (or the lost one's replacement): its prompt plus the
        tokens already streamed are prefilled again (the prefill worker's prefix cache holds
        the prompt's blocks where it still can) and decoding goes on from there, so the
        caller's stream neither repeats nor drops a token; greedy output is the same as an
        undisturbed run's. At most `config.max_migrations` times, then WorkerUnavailable.

        `report`, if given, is filled in as the request runs (its KV transfers). `tenant`: whose
        request it is (its share of the decode seats among requests of its priority, here and,
        carried in its params, in the prefill and decode engines).

        Raises WorkerUnavailable (TransportRefused: the pair's KV transport is refused),
        Overloaded or ValueError. Closing the iterator early (client cancel, deadline) aborts
        the request everywhere.
        """
        if (req.params.tenant, req.params.tenant_weight) != (tenant.name, tenant.weight):
            # The engines share their seats by tenant (`engine/tenant_share.py`): what holds the
            # share across frontends, each of which sees only its own requests.
            req = dataclasses.replace(req, params=dataclasses.replace(req.params, tenant=tenant.name,
                                                                      tenant_weight=tenant.weight))
        generated: list[int] = []
        num_lost = num_refused = 0
        # The prompt tokens the request's prefill took from cache, as its first delta says
        # (disaggregated: the prefill worker's; the decode worker's deltas count the KV it was
        # sent as not cached), for all its deltas and continuations.
        num_cached: int | None = None
        for attempt in itertools.count():
            run = req if attempt == 0 else _continuation(req, generated, attempt)
            one = _Attempt(self, run, migrated=num_lost > 0, retried=attempt > 0, report=report, tenant=tenant)
            try:
                # aclosing: a caller that stops early ends the attempt (and its cleanup) at once.
                async with contextlib.aclosing(one.run()) as deltas:
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
                if num_refused > self._config.reserve_retries:
                    raise Overloaded(str(e)) from e
                await asyncio.sleep(self._config.load_refresh_s)  # the worker frees them within a step
            except WorkerLost as e:
                num_lost += 1
                if num_lost > self._config.max_migrations:
                    raise WorkerUnavailable(f"{e} (gave up after {attempt + 1} attempts)") from e
                logger.warning("request %s: %s; continuing it elsewhere after %d tokens", req.request_id, e,
                               len(generated))
                self._metrics.migrations.inc()

    def _in_background(self, aborting: asyncio.Future[None]) -> None:
        """Hold an abort that outlives its attempt until it is done."""
        self._aborting.add(aborting)
        aborting.add_done_callback(self._aborting.discard)


class _Attempt:
    """One attempt at a request on one decode worker (and one prefill worker). It owns its
    seats for its whole life: the decode seat from its taking (or, colocated, the worker's)
    through the reservation, the prefill, the admission and the stream to its release, freed at
    once if the request ended there, else once its abort on the worker has been; a prefill seat
    while its prefill runs. Finding no healthy worker of a role, it waits (`may_wait`) for a lost
    one's replacement. A `retried` request (one that lost its worker or its reservation) waits
    for a seat at the head of the queue."""

    def __init__(self, coordinator: Coordinator, req: WorkerRequest, migrated: bool, retried: bool,
                 report: RequestReport | None, tenant: Tenant = DEFAULT_TENANT) -> None:
        self._coordinator = coordinator
        self._workers = coordinator._workers
        self._config = coordinator._config
        self._req = req
        self._migrated = migrated
        self._retried = retried
        self._report = report
        self._tenant = tenant
        self._hops: dict[str, float] = {} if report is None or migrated else report.hops
        self._seat: Seat | None = None  # the decode seat, once taken
        self._admitting: asyncio.Future[None] | None = None
        self._finished = False

    async def run(self) -> AsyncIterator[TokenDelta]:
        req = self._req
        started = time.perf_counter()
        prompt = PromptBlocks.of(req.prompt_token_ids, self._coordinator._block_size, req.params.cache_salt)
        give_up = asyncio.get_running_loop().time() + self._config.migration_wait_s
        colocated = self._workers.mode == "colocated"
        if colocated:
            seat = await self._workers.place(req.request_id, prompt, self._migrated, give_up, prefill=False)
        else:
            seat = await self._workers.take_decode_seat(req.request_id, len(req.prompt_token_ids), self._retried,
                                                        self._migrated, give_up, prompt,
                                                        req.params.priority, self._tenant)
        self._seat = seat
        self._hops["seat"] = time.perf_counter() - started
        queue = self._workers.open_stream(seat)
        try:
            if colocated:
                await self._submit(seat)
            else:
                first = await self._prefill(seat, prompt, give_up)
                self._finished = first.finished
                yield first  # the decode worker admits the request meanwhile: not on the first token's path
                if self._finished:
                    return
                await self._admitting
            waited = time.perf_counter()
            while True:
                item = await take_coalesced(queue)  # one chunk for all a slow reader missed
                if isinstance(item, Exception):
                    raise item
                if "first_delta" not in self._hops and colocated:
                    self._hops["first_delta"] = time.perf_counter() - waited
                self._finished = item.finished
                yield item
                if self._finished:
                    return
        finally:
            await self._release(seat)

    async def _release(self, seat: Seat) -> None:
        """The attempt's end, however it came: its stream closes; a request that did not finish
        is aborted on its decode worker, whose seat and blocks stay its own until the abort has
        freed them there; otherwise (or on a lost worker) the seat is free at once."""
        rid = seat.request_id
        self._workers.close_stream(rid)
        admitting = self._admitting
        if admitting is not None and not admitting.done():
            # The abort must reach the decode worker after the admit, not overtake it.
            await asyncio.wait([admitting], timeout=self._config.abort_timeout_s)
            if admitting.done() and not admitting.cancelled() and admitting.exception() is not None:
                logger.info("request %s: admit after its end failed: %s", rid, admitting.exception())
        if not self._finished and seat.worker.state.healthy:
            self._coordinator._in_background(asyncio.ensure_future(self._abort(seat, free=True)))
        else:
            seat.free()

    async def _submit(self, seat: Seat) -> None:
        """Colocated: the decode worker takes the whole request."""
        submitted = time.perf_counter()
        try:
            await seat.worker.actor.submit.remote(self._req)
        except NoCapacity as e:  # other frontends fill its queue: this one's view of it was stale
            raise _NoRoom(f"worker {seat.worker.worker_id}: {cause(e)}") from e
        except ACTOR_LOST as e:
            await self._workers.lost(seat.worker)
            raise WorkerLost(f"worker {seat.worker.worker_id} was lost") from e
        self._hops["submit"] = time.perf_counter() - submitted

    async def _prefill(self, decode: Seat, prompt: PromptBlocks, give_up: float) -> TokenDelta:
        """Reserve on `decode` and prefill elsewhere at once, hand the KV over; returns the
        first token's delta and, unless that ended the request, starts its admission on
        `decode` (`_admitting`: the first token need not wait for it). The receiver holds KV
        that arrives before its reservation, so the reservation (a call that waits for the
        decode engine's current step) is not on the first token's path; a refused one
        cancels the prefill."""
        req, hops = self._req, self._hops
        prefill = await self._workers.place(req.request_id, prompt, self._migrated, give_up, prefill=True)
        try:
            called = time.perf_counter()
            ref = prefill.worker.actor.prefill.remote(req, decode.worker.address)
            try:
                await self._reserve(decode)
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
                await self._workers.lost(prefill.worker)
                raise WorkerLost(f"prefill worker {prefill.worker.worker_id} was lost") from e
            except TransferError as e:
                raise _transfer_failed(decode.worker, e) from e
        finally:
            prefill.free()
        if out.times is not None:
            hops.update(prefill_queue=out.times.queue_s, prefill_compute=out.times.compute_s,
                        kv_wait=out.times.kv_wait_s, prefill_rpc=time.perf_counter() - called - out.times.total_s)
        if out.transfer is not None:
            self._coordinator._metrics.kv_transfer(out.transfer)
            if self._report is not None:
                self._report.transfers.append(out.transfer)
        if not out.needs_decode:  # the first token ended it: give the reservation back
            await self._abort(decode)
            return out.first
        self._admitting = asyncio.ensure_future(self._admit(decode, out.first.token_ids[0], out.grammar,
                                                            out.draft_state))
        return out.first

    async def _reserve(self, decode: Seat) -> None:
        try:
            await decode.worker.actor.reserve.remote(self._req)
            decode.reserved()
        except NoCapacity as e:
            raise _NoRoom(f"decode worker {decode.worker.worker_id}: {cause(e)}") from e
        except ACTOR_LOST as e:
            await self._workers.lost(decode.worker)
            raise WorkerLost(f"decode worker {decode.worker.worker_id} was lost") from e

    async def _admit(self, decode: Seat, first_token_id: int, grammar: str | None, draft_state: bytes) -> None:
        try:
            await decode.worker.actor.admit.remote(decode.request_id, first_token_id, grammar, draft_state)
        except TransferError as e:
            raise _transfer_failed(decode.worker, e) from e
        except ACTOR_LOST as e:
            await self._workers.lost(decode.worker)
            raise WorkerLost(f"decode worker {decode.worker.worker_id} was lost") from e

    async def _abort(self, seat: Seat, free: bool = False) -> None:
        """Abort the request on the seat's worker; then, if `free`, free the seat."""
        try:
            await asyncio.wait_for(seat.worker.actor.abort.remote(seat.request_id), self._config.abort_timeout_s)
        except Exception:  # noqa: BLE001 - a lost worker is handled by the health loop
            logger.warning("abort of %s on %s failed", seat.request_id, seat.worker.worker_id)
        finally:
            if free:
                seat.free()
