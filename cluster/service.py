"""The pdserve.v1.Generation gRPC service: validate, run through the coordinator, stream text."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import grpc

from pdserve.cluster.coordinator import Coordinator, Overloaded, WorkerUnavailable
from pdserve.cluster.metrics import Metrics
from pdserve.cluster.validation import parse_request
from pdserve.engine.messages import WorkerRequest
from pdserve.engine.outputs import TextDelta
from pdserve.engine.request_processor import OutputStream, RequestProcessor
from pdserve.engine.sequence import FinishReason
from pdserve.proto.v1 import generation_pb2 as pb
from pdserve.proto.v1 import generation_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

_FINISH = {FinishReason.STOP: pb.FINISH_REASON_STOP, FinishReason.LENGTH: pb.FINISH_REASON_LENGTH}
VERSION = "0.1.0"


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(self, coordinator: Coordinator, processor: RequestProcessor, metrics: Metrics,
                 default_timeout_s: float, retry_after_s: float) -> None:
        self.coordinator = coordinator
        self.processor = processor
        self.metrics = metrics
        self.default_timeout_s = default_timeout_s
        self.retry_after_s = retry_after_s
        self.inflight = 0

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        start = time.perf_counter()
        try:
            parsed = parse_request(request, self.processor)
        except ValueError as e:
            self.metrics.requests.labels("INVALID_ARGUMENT").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        capacity = self.coordinator.capacity()  # seats + bounded queues of the healthy decode workers
        if self.inflight >= capacity:
            self.metrics.requests.labels("RESOURCE_EXHAUSTED").inc()
            # gRPC's retry pushback: a client's retry policy waits this long.
            context.set_trailing_metadata((("grpc-retry-pushback-ms", str(int(self.retry_after_s * 1000))),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"server is at its capacity of {capacity} concurrent requests (running and "
                                f"queued); retry in {self.retry_after_s:g} s")
        client_id = request.request_id
        worker_req = WorkerRequest(uuid.uuid4().hex, parsed.prompt_token_ids, parsed.params)  # no stop strings
        remaining = context.time_remaining()
        timeout = self.default_timeout_s if remaining is None else max(0.0, remaining)
        self.inflight += 1
        status = "OK"
        try:
            async with asyncio.timeout(timeout):
                async for response in self._stream(worker_req, self.processor.output_stream(parsed),
                                                   client_id or worker_req.request_id, start):
                    yield response
        except TimeoutError:
            status = "DEADLINE_EXCEEDED"
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"request exceeded its deadline of {timeout:.1f} s")
        except Overloaded as e:
            status = "RESOURCE_EXHAUSTED"
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except WorkerUnavailable as e:
            status = "UNAVAILABLE"
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except asyncio.CancelledError:
            status = "CANCELLED"
            raise
        except grpc.aio.AbortError:
            raise
        except Exception:  # a bug, not the client's fault: log it, tell the client no more than that
            status = "INTERNAL"
            logger.exception("request %s failed", worker_req.request_id)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error in request {worker_req.request_id}")
        finally:
            self.inflight -= 1
            self.metrics.requests.labels(status).inc()

    async def _stream(self, req: WorkerRequest, stream: OutputStream, client_id: str, start: float):
        num_generated = 0
        last = None
        deltas = self.coordinator.generate(req)
        try:
            async for delta in deltas:
                now = time.perf_counter()
                if last is None:
                    self.metrics.ttft.observe(now - start)
                else:
                    self.metrics.itl.observe(now - last)
                last = now
                if delta.finish_reason is FinishReason.ABORT:
                    raise WorkerUnavailable("the worker aborted the request")
                out = stream.add(delta)
                num_generated += len(out.token_ids)
                yield self._response(client_id, out, len(req.prompt_token_ids), num_generated)
                if out.finished:  # a stop string too: the coordinator aborts the workers when we return
                    self.metrics.e2e.observe(now - start)
                    self.metrics.tokens.inc(num_generated)
                    return
        finally:
            await deltas.aclose()

    @staticmethod
    def _response(client_id: str, delta: TextDelta, num_prompt: int, num_generated: int) -> pb.GenerateResponse:
        resp = pb.GenerateResponse(request_id=client_id, token_ids=list(delta.token_ids), text=delta.text)
        for lp in delta.logprobs:
            resp.logprobs.add(token_id=lp.token_id, logprob=lp.logprob, top_token_ids=list(lp.top_token_ids),
                              top_logprobs=list(lp.top_logprobs))
        if delta.finish_reason is not None:
            resp.finish_reason = _FINISH[delta.finish_reason]
            resp.usage.prompt_tokens = num_prompt
            resp.usage.completion_tokens = num_generated
            resp.usage.cached_prompt_tokens = delta.num_cached_tokens
        return resp

    async def ListModels(self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        p = self.processor
        return pb.ListModelsResponse(models=[pb.ModelInfo(id=p.model_name, max_model_len=p.max_model_len,
                                                          vocab_size=p.vocab_size)])

    async def GetServerInfo(self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        info = pb.ServerInfo(version=VERSION, mode=self.coordinator.mode, model=self.processor.model_name)
        for pool in self.coordinator.pools():
            for w in pool.workers:
                load = w.state.load
                info.workers.add(id=w.worker_id, role=w.role, healthy=w.state.healthy,
                                 running=load.num_running if load else 0, waiting=load.num_waiting if load else 0,
                                 free_kv_blocks=load.num_free_blocks if load else 0,
                                 total_kv_blocks=load.num_blocks if load else 0)
        return info
