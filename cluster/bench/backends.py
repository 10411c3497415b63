"""The two APIs `pdserve bench` drives: pdserve's gRPC Generation service and the OpenAI
HTTP API (any server that speaks it). Each streams one request and records when output
arrived; neither interprets the text."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from pdserve.cluster.bench.dataset import BenchRequest
from pdserve.cluster.clients.credentials import ClientCredentials
from pdserve.proto.v1 import generation_pb2 as pb
from pdserve.proto.v1 import generation_pb2_grpc as pb_grpc


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it. Times are perf_counter seconds."""

    start: float
    chunk_times: list[float] = field(default_factory=list)  # when each streamed chunk with output arrived
    output_tokens: int = 0
    input_tokens: int | None = None
    cached_tokens: int | None = None  # prompt tokens the server took from its KV caches (None: not said)
    output_ids: list[int] = field(default_factory=list)  # the answer's token ids, where the API gives them
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.output_tokens > 0

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2el(self) -> float:
        return self.chunk_times[-1] - self.start

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (None for one-token answers)."""
        if self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


class Backend(Protocol):
    name: str

    async def vocab_size(self) -> int | None: ...

    async def send(self, request: BenchRequest, timeout_s: float) -> RequestResult: ...

    async def close(self) -> None: ...


class GrpcBackend:
    """pdserve.v1.Generation over one asyncio channel. Requests sample at `temperature` and
    ignore EOS, so every answer has the length it asked for; each has `priority` (lower first)."""

    name = "grpc"

    def __init__(self, target: str, temperature: float = 1.0, credentials: ClientCredentials | None = None,
                 priority: int = 0) -> None:
        credentials = credentials or ClientCredentials()
        self._channel = credentials.grpc_aio_channel(target)
        self._metadata = credentials.grpc_metadata()
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._temperature = temperature
        self._priority = priority

    async def vocab_size(self) -> int | None:
        models = await self._stub.ListModels(pb.ListModelsRequest(), timeout=30, metadata=self._metadata)
        return models.models[0].vocab_size if models.models else None

    async def send(self, request: BenchRequest, timeout_s: float) -> RequestResult:
        msg = pb.GenerateRequest(sampling=pb.SamplingParams(
            temperature=self._temperature, max_tokens=request.output_len, ignore_eos=True), priority=self._priority)
        if request.prompt_ids is not None:
            msg.prompt_token_ids.ids.extend(request.prompt_ids)
        elif request.prompt is not None:
            msg.prompt = request.prompt
        else:
            msg.messages.messages.extend(pb.ChatMessage(**m) for m in request.messages or ())
        result = RequestResult(start=time.perf_counter(), input_tokens=request.input_len)
        try:
            async for resp in self._stub.Generate(msg, timeout=timeout_s, metadata=self._metadata):
                if resp.token_ids:
                    result.chunk_times.append(time.perf_counter())
                    result.output_tokens += len(resp.token_ids)
                    result.output_ids.extend(resp.token_ids)
                if resp.HasField("usage"):
                    result.input_tokens = resp.usage.prompt_tokens
                    result.cached_tokens = resp.usage.cached_prompt_tokens
        except grpc.aio.AioRpcError as e:
            result.error = f"{e.code().name}: {e.details()}"
        return result

    async def close(self) -> None:
        await self._channel.close()


class OpenAIBackend:
    """POST /v1/completions (prompts, token ids) or /v1/chat/completions (messages), streamed
    as server-sent events with usage in the last chunk."""

    name = "openai"

    def __init__(self, base_url: str, model: str | None = None, temperature: float = 1.0,
                 credentials: ClientCredentials | None = None) -> None:
        import httpx

        self._httpx = httpx
        credentials = credentials or ClientCredentials()
        self._client = httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=credentials.http_headers(),
                                         verify=credentials.ssl_context() or True,
                                         timeout=httpx.Timeout(600.0, connect=30.0))
        self._model = model
        self._temperature = temperature

    async def _model_name(self) -> str:
        if self._model is None:
            response = await self._client.get("/v1/models")
            response.raise_for_status()
            self._model = response.json()["data"][0]["id"]
        return self._model

    async def vocab_size(self) -> int | None:
        return None  # not part of the OpenAI API: random prompts need --vocab-size

    async def send(self, request: BenchRequest, timeout_s: float) -> RequestResult:
        body: dict[str, object] = {"model": await self._model_name(), "max_tokens": request.output_len,
                                   "temperature": self._temperature, "ignore_eos": True, "stream": True,
                                   "stream_options": {"include_usage": True}}
        if request.messages is not None:
            path, body["messages"] = "/v1/chat/completions", list(request.messages)
        else:
            path = "/v1/completions"
            body["prompt"] = list(request.prompt_ids) if request.prompt_ids is not None else request.prompt
        result = RequestResult(start=time.perf_counter(), input_tokens=request.input_len)
        streamed = 0
        try:
            async with self._client.stream("POST", path, json=body, timeout=timeout_s) as response:
                if response.status_code != 200:
                    result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                    return result
                async for line in response.aiter_lines():
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    if any(_chunk_text(choice) for choice in chunk.get("choices") or ()):
                        result.chunk_times.append(time.perf_counter())
                        streamed += 1
                    if usage := chunk.get("usage"):
                        result.output_tokens = usage["completion_tokens"]
                        result.input_tokens = usage["prompt_tokens"]
                        if details := usage.get("prompt_tokens_details"):
                            result.cached_tokens = details.get("cached_tokens")
        except self._httpx.HTTPError as e:
            result.error = f"{type(e).__name__}: {e}"
        if not result.output_tokens:  # a server that sends no usage: one token per chunk
            result.output_tokens = streamed
        return result

    async def close(self) -> None:
        await self._client.aclose()


def _chunk_text(choice: dict) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""
