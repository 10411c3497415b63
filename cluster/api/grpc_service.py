"""The pdserve.v1.Generation gRPC service: proto in, the shared `Frontend` path, proto out."""

from __future__ import annotations

import uuid

import grpc

from pdserve.cluster.api.frontend import Frontend, RequestFailed, Status
from pdserve.cluster.api.grpc_request import parse_request
from pdserve.cluster.serving.coordinator import RequestReport
from pdserve.engine.outputs import TextDelta
from pdserve.engine.sequence import FinishReason
from pdserve.proto.v1 import generation_pb2 as pb
from pdserve.proto.v1 import generation_pb2_grpc as pb_grpc

_FINISH = {FinishReason.STOP: pb.FINISH_REASON_STOP, FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
           FinishReason.TOOL_CALLS: pb.FINISH_REASON_TOOL_CALLS}
VERSION = "0.1.0"
_CODES = {
    Status.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    Status.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Status.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Status.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    Status.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Status.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    Status.CANCELLED: grpc.StatusCode.CANCELLED,
    Status.INTERNAL: grpc.StatusCode.INTERNAL,
}


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
        self.coordinator = frontend.coordinator
        self.processor = frontend.processor

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        try:
            parsed = parse_request(request, self.processor)
        except ValueError as e:
            self.frontend.count(Status.INVALID_ARGUMENT)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        num_prompt, num_generated = len(parsed.prompt_token_ids), 0
        client_id = request.request_id or uuid.uuid4().hex
        report = RequestReport()
        try:
            tenant = self.frontend.tenants.of(dict(context.invocation_metadata() or ()).get("authorization"))
            async for delta in self.frontend.generate(parsed, context.time_remaining(), report, tenant):
                num_generated += len(delta.token_ids)
                yield self._response(client_id, delta, num_prompt, num_generated, report)
        except RequestFailed as e:
            if e.retry_after_s is not None:  # gRPC's retry pushback: a client's retry policy waits this long
                context.set_trailing_metadata((("grpc-retry-pushback-ms", str(int(e.retry_after_s * 1000))),))
            await context.abort(_CODES[e.status], str(e))

    @staticmethod
    def _response(client_id: str, delta: TextDelta, num_prompt: int, num_generated: int,
                  report: RequestReport) -> pb.GenerateResponse:
        """`delta` as a response: its answer's content in `text` (a reasoning model's chat: its
        thinking in `reasoning`; with tools: the calls it completed in `tool_calls`)."""
        answer = delta.answer
        resp = pb.GenerateResponse(request_id=client_id, token_ids=list(delta.token_ids), text=answer.content,
                                   reasoning=answer.reasoning)
        for call in answer.tool_calls:
            resp.tool_calls.add(id=call.id, name=call.name, arguments=call.arguments)
        for lp in delta.logprobs:
            resp.logprobs.add(token_id=lp.token_id, logprob=lp.logprob, top_token_ids=list(lp.top_token_ids),
                              top_logprobs=list(lp.top_logprobs), rank=lp.rank)
        for lp in delta.prompt_logprobs[1:]:  # nothing predicts the first
            assert lp is not None
            resp.prompt_logprobs.add(token_id=lp.token_id, logprob=lp.logprob, top_token_ids=list(lp.top_token_ids),
                                     top_logprobs=list(lp.top_logprobs), rank=lp.rank)
        if delta.finish_reason is not None:
            resp.finish_reason = _FINISH[delta.finish_reason]
            resp.usage.prompt_tokens = num_prompt
            resp.usage.completion_tokens = num_generated
            resp.usage.cached_prompt_tokens = delta.num_cached_tokens
            for t in report.transfers:
                resp.kv_transfers.add(transport=t.transport, direct=t.direct, bytes=t.num_bytes, seconds=t.elapsed_s)
        return resp

    async def ListModels(self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        p = self.processor
        return pb.ListModelsResponse(models=[pb.ModelInfo(id=p.model_name, max_model_len=p.max_model_len,
                                                          vocab_size=p.vocab_size)])

    async def GetServerInfo(self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        info = pb.ServerInfo(version=VERSION, mode=self.coordinator.mode, model=self.processor.model_name)
        for w in self.frontend.worker_set.workers(gone=False):
            load = w.load
            info.workers.add(id=w.worker_id, role=w.role, healthy=w.healthy,
                             running=load.num_running if load else 0, waiting=load.num_waiting if load else 0,
                             free_kv_blocks=load.num_free_blocks if load else 0,
                             total_kv_blocks=load.num_blocks if load else 0,
                             cached_blocks=self.frontend.worker_set.cached_blocks(w.worker_id),
                             kv_layout=load.kv_layout if load else "",
                             kv_bytes_per_token=load.kv_bytes_per_token if load else 0)
        return info
