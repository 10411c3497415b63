"""What every API frontend shares (gRPC `GenerationService`, the OpenAI HTTP API): admission
under the concurrency limit (by priority when full: `admission.py`), the request's run through
the coordinator with its deadline, text through the request processor's `OutputStream`, latency
metrics and the request's status.

A frontend parses its wire format into a `ProcessedRequest` (through `RequestProcessor`),
iterates `Frontend.generate` and maps a `RequestFailed`'s `Status` to its own codes.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
import uuid
from collections.abc import AsyncIterator

from pdserve.cluster.api.admission import AdmissionQueue
from pdserve.cluster.serving.coordinator import Coordinator, RequestReport
from pdserve.cluster.serving.errors import Overloaded, TransportRefused, WorkerUnavailable, cause
from pdserve.cluster.serving.metrics import Metrics, priority_class
from pdserve.cluster.serving.worker_set import WorkerSet
from pdserve.cluster.settings.tenants import DEFAULT_TENANT, Tenant, Tenants
from pdserve.engine.messages import WorkerRequest, owned_request_id
from pdserve.engine.outputs import TextDelta
from pdserve.engine.sequence import FinishReason
from pdserve.engine.text.request_processor import ProcessedRequest, RequestProcessor

logger = logging.getLogger(__name__)


class Status(str, enum.Enum):
    """How a request ended, named as gRPC names it (the `status` label of pdserve_requests_total)."""

    OK = "OK"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"  # the cluster cannot serve it as configured (kv_transport.require)
    UNAVAILABLE = "UNAVAILABLE"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    CANCELLED = "CANCELLED"
    INTERNAL = "INTERNAL"


class RequestFailed(Exception):
    """A request that could not run or finish; `str(e)` is safe to show the client (one line,
    no traceback: see `failed`)."""

    def __init__(self, status: Status, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s  # RESOURCE_EXHAUSTED: when a retry may find room


def failed(status: Status, error: BaseException) -> RequestFailed:
    """`error` as the client may see it: its one-line cause (cluster/serving/errors.py). Whatever
    more its text held (a worker's traceback that came through Ray) goes to the log."""
    message = cause(error)
    if message != str(error):
        logger.warning("request failed with %s: %s", status.value, message, exc_info=error)
    return RequestFailed(status, message)


class Frontend:
    """The request path both APIs share, on the coordinator, router and pools of one server.
    The worker set is read for the server's state only (its workers, roles without one)."""

    def __init__(self, coordinator: Coordinator, worker_set: WorkerSet, processor: RequestProcessor,
                 metrics: Metrics, default_timeout_s: float, retry_after_s: float,
                 tenants: Tenants | None = None, frontend_id: str = "") -> None:
        self.coordinator = coordinator
        self.frontend_id = frontend_id  # its requests' id prefix: unique across frontends ("": the only one)
        self.worker_set = worker_set
        self.processor = processor
        self.metrics = metrics
        self.default_timeout_s = default_timeout_s
        self.retry_after_s = retry_after_s
        self.inflight = 0  # admitted and neither finished nor displaced
        self.admission = AdmissionQueue()
        self.tenants = tenants or Tenants()  # the APIs name a request's tenant from its key (`Tenants.of`)

    def count(self, status: Status) -> None:
        """Count a request a frontend refused before it ran (bad input)."""
        self.metrics.requests.labels(status.value).inc()

    def check_capacity(self, num_requests: int = 1, priority: int = 0, tenant: Tenant = DEFAULT_TENANT) -> None:
        """Raise RequestFailed(RESOURCE_EXHAUSTED, with a retry hint) unless `num_requests` more
        of `priority` for `tenant` fit the pools' capacity (`Coordinator.capacity()`: the healthy decode
        workers' running seats plus their bounded waiting queues), if need be in the places
        of queued requests they outrank (lower priority, or a tenant over its fair share), which
        are refused (`AdmissionQueue.displace`).
        A request admitted here may still be refused (Overloaded) by the coordinator's queue
        for a decode seat, where requests also wait for KV blocks: at most
        `SeatLine.max_queued()` wait there."""
        capacity = self.coordinator.capacity()
        over = self.inflight + num_requests - capacity
        # No healthy decode worker is not a full server: the coordinator answers UNAVAILABLE.
        if capacity and over > 0 and self.admission.displace(priority, over, tenant, capacity) is not None:
            self.inflight -= over
        elif capacity and over > 0:
            self.count(Status.RESOURCE_EXHAUSTED)
            self.metrics.refused.labels(tenant.name, priority_class(priority), "admission").inc(num_requests)
            raise RequestFailed(Status.RESOURCE_EXHAUSTED,
                                f"server is at its capacity of {capacity} concurrent requests (running and "
                                f"queued); retry in {self.retry_after_s:g} s", self.retry_after_s)

    async def generate(self, request: ProcessedRequest, timeout_s: float | None = None,
                       report: RequestReport | None = None, tenant: Tenant = DEFAULT_TENANT
                       ) -> AsyncIterator[TextDelta]:
        """Run one request; yields its text deltas, the last with a finish reason (STOP or LENGTH).

        timeout_s: the client's deadline (None: `default_timeout_s`). report: filled in as
        the request runs (its KV transfers, its first token's hops), complete once the last delta is out.
        tenant: whose request it is (the admission's fair share). Raises
        RequestFailed; closing the iterator early cancels the request and frees its blocks everywhere.
        """
        self.check_capacity(1, request.params.priority, tenant)
        start = time.perf_counter()
        report = report if report is not None else RequestReport()
        worker_req = request.for_worker(owned_request_id(self.frontend_id, uuid.uuid4().hex))
        timeout = self.default_timeout_s if timeout_s is None else max(0.0, timeout_s)
        deadline = asyncio.get_running_loop().time() + timeout
        self.inflight += 1
        queued = self.admission.add(request.params.priority, tenant)
        self.metrics.admitted.labels(tenant.name, priority_class(request.params.priority)).inc()
        self.metrics.arrived.inc()
        self.metrics.prompt_tokens.inc(len(request.prompt_token_ids))
        status = Status.OK
        try:
            async for delta in self._stream(worker_req, request, start, deadline, report, tenant):
                self.admission.started(queued)
                yield delta
        except TimeoutError as e:
            status = Status.DEADLINE_EXCEEDED
            raise RequestFailed(status, f"request exceeded its deadline of {timeout:.1f} s") from e
        except Overloaded as e:  # its queue for a decode seat is full, or a worker refused it
            status = Status.RESOURCE_EXHAUSTED
            self.metrics.refused.labels(tenant.name, priority_class(request.params.priority), "seat_line").inc()
            raise RequestFailed(status, f"{cause(e)}; retry in {self.retry_after_s:g} s", self.retry_after_s) from e
        except TransportRefused as e:
            status = Status.FAILED_PRECONDITION
            raise failed(status, e) from e
        except WorkerUnavailable as e:
            status = Status.UNAVAILABLE
            raise failed(status, e) from e
        except asyncio.CancelledError as e:
            if not queued.displaced:
                status = Status.CANCELLED
                raise
            asyncio.current_task().uncancel()  # our own cancel, not the client's
            self.metrics.displaced.labels(tenant.name, priority_class(request.params.priority)).inc()
            status = Status.RESOURCE_EXHAUSTED
            raise RequestFailed(status, f"server is at its capacity and a request of higher priority (or of a "
                                        f"tenant under its fair share) took this one's place; retry in "
                                        f"{self.retry_after_s:g} s", self.retry_after_s) from e
        except GeneratorExit:
            status = Status.CANCELLED
            raise
        except Exception as e:  # a bug, not the client's fault: log it, tell the client no more than that
            status = Status.INTERNAL
            logger.exception("request %s failed", worker_req.request_id)
            raise RequestFailed(status, f"internal error in request {worker_req.request_id}") from e
        finally:
            if not queued.displaced:
                self.inflight -= 1
            self.admission.ended(queued)
            self.count(status)

    async def _stream(self, req: WorkerRequest, request: ProcessedRequest, start: float, deadline: float,
                      report: RequestReport, tenant: Tenant) -> AsyncIterator[TextDelta]:
        # The deadline bounds each wait for the workers, not the caller's time between deltas:
        # a timeout scope around a `yield` would cancel whichever task is consuming the stream.
        stream = self.processor.output_stream(request)
        num_generated = 0
        last = None
        deltas = self.coordinator.generate(req, report, tenant)
        try:
            while True:
                async with asyncio.timeout_at(deadline):
                    delta = await anext(deltas, None)
                if delta is None:
                    return
                now = time.perf_counter()
                if last is None:
                    self.metrics.ttft.observe(now - start)
                    self.metrics.first_token_hops(report.hops, now - start, tenant.name, request.params.priority)
                else:
                    self.metrics.itl.observe(now - last)
                last = now
                if delta.finish_reason is FinishReason.ABORT:
                    raise WorkerUnavailable("the worker aborted the request")
                out = stream.add(delta)
                num_generated += len(out.token_ids)
                yield out
                if out.finished:  # a stop string too: the coordinator aborts the workers when we return
                    self.metrics.e2e.observe(now - start)
                    self.metrics.tokens.inc(num_generated)
                    return
        finally:
            await deltas.aclose()
