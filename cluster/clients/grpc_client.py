"""A small synchronous client of pdserve.v1.Generation (used by `pdserve generate --target`)."""

from __future__ import annotations

from collections.abc import Iterator

from pdserve.cluster.clients.credentials import ClientCredentials
from pdserve.engine.sampling import SamplingParams
from pdserve.proto.v1 import generation_pb2 as pb
from pdserve.proto.v1 import generation_pb2_grpc as pb_grpc


def sampling_to_proto(p: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
                            max_tokens=p.max_tokens, stop=list(p.stop), stop_token_ids=list(p.stop_token_ids),
                            ignore_eos=p.ignore_eos, presence_penalty=p.presence_penalty,
                            frequency_penalty=p.frequency_penalty, repetition_penalty=p.repetition_penalty,
                            logit_bias=dict(p.logit_bias), min_tokens=p.min_tokens)
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    if p.cache_salt is not None:
        msg.cache_salt = p.cache_salt
    if p.structured is not None and p.structured.kind == "json_object":
        msg.response_format.json_object.SetInParent()
    elif p.structured is not None:
        msg.response_format.json_schema = p.structured.json_schema
    return msg


class Client:
    """A gRPC client of pdserve.v1.Generation; `credentials`: TLS (mutual TLS) files and the
    bearer token it presents (None: plaintext, no token)."""

    def __init__(self, target: str, credentials: ClientCredentials | None = None) -> None:
        credentials = credentials or ClientCredentials()
        self.channel = credentials.grpc_channel(target)
        self._metadata = credentials.grpc_metadata()
        self.stub = pb_grpc.GenerationStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(self, prompt: str | list[int] | None = None, params: SamplingParams | None = None,
                 messages: list[dict[str, str]] | None = None, timeout_s: float | None = None
                 ) -> Iterator[pb.GenerateResponse]:
        params = params or SamplingParams()
        req = pb.GenerateRequest(sampling=sampling_to_proto(params), priority=params.priority)
        if messages is not None:
            req.messages.messages.extend(pb.ChatMessage(**m) for m in messages)
        elif isinstance(prompt, str):
            req.prompt = prompt
        else:
            req.prompt_token_ids.ids.extend(prompt or [])
        return self.stub.Generate(req, timeout=timeout_s, metadata=self._metadata)

    def server_info(self, timeout_s: float = 10.0) -> pb.ServerInfo:
        return self.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=timeout_s, metadata=self._metadata)

    def list_models(self, timeout_s: float = 10.0) -> pb.ListModelsResponse:
        return self.stub.ListModels(pb.ListModelsRequest(), timeout=timeout_s, metadata=self._metadata)
