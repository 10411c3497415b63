"""A GenerateRequest as the request processor takes it: proto fields in, a ProcessedRequest
(or a ValueError naming the bad field) out. The checks themselves are the processor's."""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format

from pdserve.engine.request_processor import ProcessedRequest, RequestProcessor
from pdserve.engine.sampling import SamplingParams, StructuredOutput
from pdserve.proto.v1 import generation_pb2 as pb


def sampling_from_proto(s: pb.SamplingParams) -> SamplingParams:
    """Unset fields take SamplingParams' defaults; bad values raise ValueError naming the field."""
    kwargs: dict[str, Any] = {}
    for name in ("temperature", "top_p", "top_k", "min_p", "max_tokens", "seed", "logprobs", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "min_tokens"):
        if s.HasField(name):
            kwargs[name] = getattr(s, name)
    kwargs["logit_bias"] = dict(s.logit_bias)
    kwargs["stop"] = tuple(s.stop)
    kwargs["stop_token_ids"] = tuple(s.stop_token_ids)
    kwargs["ignore_eos"] = s.ignore_eos
    kwargs["structured"] = _structured(s.response_format) if s.HasField("response_format") else None
    return SamplingParams(**kwargs)


def _structured(f: pb.ResponseFormat) -> StructuredOutput | None:
    which = f.WhichOneof("format")
    if which == "json_object":
        return StructuredOutput("json_object")
    if which == "json_schema":
        return StructuredOutput.from_schema(f.json_schema)
    return None


def parse_request(request: pb.GenerateRequest, processor: RequestProcessor) -> ProcessedRequest:
    if request.model and request.model != processor.model_name:
        raise ValueError(f"model {request.model!r} is not served here; this server serves {processor.model_name!r}")
    which = request.WhichOneof("input")
    if which is None:
        raise ValueError("one of prompt, prompt_token_ids or messages is required")
    try:
        params = sampling_from_proto(request.sampling)
        params.check_min_tokens()
        processor.check_params(params)
    except ValueError as e:
        raise ValueError(f"sampling.{e}") from e
    if which == "messages":
        messages = [{"role": m.role, "content": m.content} for m in request.messages.messages]
        kwargs = None
        if request.messages.HasField("chat_template_kwargs"):
            kwargs = json_format.MessageToDict(request.messages.chat_template_kwargs)
        return processor.process(messages=messages, params=params, chat_template_kwargs=kwargs)
    prompt = request.prompt if which == "prompt" else list(request.prompt_token_ids.ids)
    return processor.process(prompt, params=params, token_ids_field="prompt_token_ids")
