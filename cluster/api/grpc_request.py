"""A GenerateRequest as the request processor takes it: proto fields in, a ProcessedRequest
(or a ValueError naming the bad field) out. The checks themselves are the processor's."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from google.protobuf import json_format

from pdserve.engine.sampling import SamplingParams, StructuredOutput
from pdserve.engine.text.request_processor import ProcessedRequest, RequestProcessor, prompt_only
from pdserve.engine.text.tools import ToolRequest, tool_request
from pdserve.proto.v1 import generation_pb2 as pb


def sampling_from_proto(s: pb.SamplingParams) -> SamplingParams:
    """Unset fields take SamplingParams' defaults; bad values raise ValueError naming the field."""
    kwargs: dict[str, Any] = {}
    for name in ("temperature", "top_p", "top_k", "min_p", "max_tokens", "seed", "logprobs", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "min_tokens", "prompt_logprobs",
                 "cache_salt"):
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
    sampling = request.sampling
    # max_tokens 0 asks for the prompt's log-probabilities alone: run with 1, its token dropped.
    only_prompt = sampling.HasField("max_tokens") and sampling.max_tokens == 0
    if only_prompt and not sampling.HasField("prompt_logprobs"):
        raise ValueError("sampling.max_tokens must be >= 1 (0 only with prompt_logprobs), got 0")
    try:
        if only_prompt:
            sampling = pb.SamplingParams()
            sampling.CopyFrom(request.sampling)
            sampling.max_tokens = 1
        params = dataclasses.replace(sampling_from_proto(sampling), priority=request.priority)
        params.check_min_tokens()
        processor.check_params(params)
    except ValueError as e:
        raise ValueError(f"sampling.{e}") from e
    if which == "messages":
        chat = request.messages
        messages = [_message(i, m) for i, m in enumerate(chat.messages)]
        kwargs = None
        if chat.HasField("chat_template_kwargs"):
            kwargs = json_format.MessageToDict(chat.chat_template_kwargs)
    if which == "messages":
        processed = processor.process(messages=messages, params=params, chat_template_kwargs=kwargs,
                                      tools=_tools(chat), params_checked=True)
    else:
        prompt = request.prompt if which == "prompt" else list(request.prompt_token_ids.ids)
        processed = processor.process(prompt, params=params, token_ids_field="prompt_token_ids",
                                      params_checked=True)
    return prompt_only(processed) if only_prompt else processed


def _message(i: int, m: pb.ChatMessage) -> dict[str, Any]:
    """A chat message as templates read it (as the OpenAI API's: engine/text/tools.py's forms)."""
    message: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        if m.role != "assistant":
            raise ValueError(f"messages[{i}].tool_calls: only an assistant message carries tool calls")
        message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.name, "arguments": _arguments(f"messages[{i}].tool_calls[{j}].arguments", c.arguments)}}
            for j, c in enumerate(m.tool_calls)]
    if m.tool_call_id:
        message["tool_call_id"] = m.tool_call_id
    return message


def _arguments(field: str, text: str) -> dict[str, Any]:
    try:
        arguments = json.loads(text or "{}")
    except json.JSONDecodeError as e:
        raise ValueError(f"{field} is not JSON: {e}") from e
    if not isinstance(arguments, dict):
        raise ValueError(f"{field} must be a JSON object")
    return arguments


def _tools(chat: pb.ChatMessages) -> ToolRequest | None:
    """The OpenAI form of the chat's tools, checked as the HTTP API's are (engine/text/tools.py)."""
    tools = []
    for i, t in enumerate(chat.tools):
        function: dict[str, Any] = {"name": t.name, "description": t.description}
        if t.parameters:
            function["parameters"] = _arguments(f"tools[{i}].parameters", t.parameters)
        tools.append({"type": "function", "function": function})
    which = chat.tool_choice.WhichOneof("choice") if chat.HasField("tool_choice") else None
    choice: str | dict[str, Any] | None = None
    if which == "mode":
        choice = chat.tool_choice.mode
    elif which == "function":
        choice = {"type": "function", "function": {"name": chat.tool_choice.function}}
    parallel = chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else None
    return tool_request(tools, choice, parallel)
