"""Turning a GenerateRequest into a WorkerRequest, or a ValueError naming the bad field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.sampling import SamplingParams
from proto.pdserve.v1 import generation_pb2 as pb


@dataclass(frozen=True, slots=True)
class ModelLimits:
    name: str
    vocab_size: int
    max_model_len: int


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams  # the client's, stop strings included
    stop: tuple[str, ...]


def sampling_from_proto(s: pb.SamplingParams) -> SamplingParams:
    """Unset fields take SamplingParams' defaults; bad values raise ValueError naming the field."""
    kwargs: dict[str, Any] = {}
    for name in ("temperature", "top_p", "top_k", "min_p", "max_tokens", "seed", "logprobs"):
        if s.HasField(name):
            kwargs[name] = getattr(s, name)
    kwargs["stop"] = tuple(s.stop)
    kwargs["stop_token_ids"] = tuple(s.stop_token_ids)
    kwargs["ignore_eos"] = s.ignore_eos
    return SamplingParams(**kwargs)


def parse_request(request: pb.GenerateRequest, limits: ModelLimits, tokenizer: Any) -> ParsedRequest:
    if request.model and request.model != limits.name:
        raise ValueError(f"model {request.model!r} is not served here; this server serves {limits.name!r}")
    which = request.WhichOneof("input")
    if which is None:
        raise ValueError("one of prompt, prompt_token_ids or messages is required")
    if tokenizer is None and which != "prompt_token_ids":
        raise ValueError(f"model {limits.name!r} has no tokenizer: send prompt_token_ids")
    if which == "prompt":
        if not request.prompt:
            raise ValueError("prompt is empty")
        ids = tokenizer.encode(request.prompt)
    elif which == "prompt_token_ids":
        ids = list(request.prompt_token_ids.ids)
        bad = [t for t in ids if not 0 <= t < limits.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids {bad[:4]} are outside the vocabulary [0, {limits.vocab_size})")
    else:
        messages = [{"role": m.role, "content": m.content} for m in request.messages.messages]
        if not messages:
            raise ValueError("messages is empty")
        roles = {m["role"] for m in messages} - {"system", "user", "assistant"}
        if roles:
            raise ValueError(f"messages has unknown roles {sorted(roles)}; use system, user or assistant")
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise ValueError(f"{which} is empty")
    if len(ids) >= limits.max_model_len:
        raise ValueError(f"{which} has {len(ids)} tokens; the model's context is {limits.max_model_len} "
                         f"(prompt plus at least one new token)")
    try:
        params = sampling_from_proto(request.sampling)
    except ValueError as e:
        raise ValueError(f"sampling.{e}") from e
    if params.stop and tokenizer is None:
        raise ValueError(f"sampling.stop needs a tokenizer; model {limits.name!r} has none")
    bad = [t for t in params.stop_token_ids if t >= limits.vocab_size]
    if bad:
        raise ValueError(f"sampling.stop_token_ids {bad} are outside the vocabulary [0, {limits.vocab_size})")
    return ParsedRequest(tuple(ids), params, params.stop)
