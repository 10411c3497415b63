"""OpenAI bodies <-> pdserve: a request becomes its choices (one `ProcessedRequest` each,
validated by the request processor), and choices' text deltas become OpenAI's responses
and stream chunks (completions and chat completions)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pdserve.cluster import openai_models as m
from pdserve.engine.outputs import RequestOutput, TextDelta
from pdserve.engine.reasoning import ReasoningSplitter
from pdserve.engine.request_processor import ProcessedRequest, RequestProcessor
from pdserve.engine.sampler import TokenLogprobs
from pdserve.engine.sampling import SamplingParams


@dataclass(slots=True)
class Choice:
    """One generated sequence of an API call: choice `index`, sample `sample` of prompt `prompt_index`."""

    index: int
    prompt_index: int
    sample: int
    request: ProcessedRequest
    output: RequestOutput = field(init=False)

    def __post_init__(self) -> None:
        self.output = RequestOutput(str(self.index), self.request.prompt_token_ids)


# Requests -------------------------------------------------------------------


def completion_choices(req: m.CompletionRequest, processor: RequestProcessor) -> list[Choice]:
    """Raises ValueError naming the bad field."""
    prompts = _prompts(req.prompt)
    params = _sampling(req, 16 if req.max_tokens is None else req.max_tokens, req.logprobs)
    return _expand([processor.process(p, params=params) for p in prompts], req.n)


def chat_choices(req: m.ChatCompletionRequest, processor: RequestProcessor) -> list[Choice]:
    """Raises ValueError naming the bad field. Without max_tokens the reply may fill the context."""
    if req.top_logprobs is not None and not req.logprobs:
        raise ValueError("top_logprobs needs logprobs: true")
    max_field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    try:
        # Without max_tokens, the context bounds min_tokens until the prompt's length is known.
        params = _sampling(req, processor.max_model_len if max_tokens is None else max_tokens,
                           (req.top_logprobs or 0) if req.logprobs else None)
    except ValueError as e:
        raise ValueError(str(e).replace("max_tokens", max_field, 1).replace("logprobs", "top_logprobs", 1)) from e
    processed = processor.process(messages=[_message(i, msg) for i, msg in enumerate(req.messages)], params=params,
                                  chat_template_kwargs=req.chat_template_kwargs)
    if max_tokens is None:
        rest = processor.max_model_len - len(processed.prompt_token_ids)
        processed = dataclasses.replace(processed, params=dataclasses.replace(processed.params, max_tokens=rest))
    return _expand([processed], req.n)


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ValueError("prompt is empty")
    if isinstance(prompt[0], int):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


def _message(i: int, msg: m.ChatMessage) -> dict[str, str]:
    role = "system" if msg.role == "developer" else msg.role
    if msg.content is None or isinstance(msg.content, str):
        return {"role": role, "content": msg.content or ""}
    parts = []
    for part in msg.content:
        if part.type != "text" or part.text is None:
            raise ValueError(f"messages[{i}].content: only text parts are supported, got {part.type!r}")
        parts.append(part.text)
    return {"role": role, "content": "".join(parts)}


# The request fields that are SamplingParams' own, taken as they are when set.
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "logit_bias", "min_tokens")


def _sampling(req: m.CompletionRequest | m.ChatCompletionRequest, max_tokens: int,
              logprobs: int | None) -> SamplingParams:
    kwargs: dict[str, Any] = {name: getattr(req, name) for name in _SAMPLING_FIELDS if getattr(req, name) is not None}
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    structured = req.response_format.structured() if req.response_format is not None else None
    return SamplingParams(**kwargs, max_tokens=max_tokens, stop=stop, stop_token_ids=tuple(req.stop_token_ids or ()),
                          ignore_eos=req.ignore_eos, logprobs=logprobs, structured=structured)


def _expand(requests: list[ProcessedRequest], n: int) -> list[Choice]:
    """n choices per prompt; with a seed, sample i draws from seed + i (reproducible, and distinct).
    Raises ValueError when a request's min_tokens exceeds its max_tokens (known only now for a
    chat without max_tokens: the rest of the context)."""
    choices = []
    for p, request in enumerate(requests):
        request.params.check_min_tokens()
        seed = request.params.seed
        for i in range(n):
            sample = request
            if seed is not None and i:
                sample = dataclasses.replace(request, params=dataclasses.replace(request.params, seed=seed + i))
            choices.append(Choice(len(choices), p, i, sample))
    return choices


def usage(choices: list[Choice]) -> m.Usage:
    """Each prompt counts once, however many samples it has."""
    firsts = [c for c in choices if c.sample == 0]
    num_prompt = sum(len(c.request.prompt_token_ids) for c in firsts)
    num_generated = sum(len(c.output.token_ids) for c in choices)
    return m.Usage(prompt_tokens=num_prompt, completion_tokens=num_generated, total_tokens=num_prompt + num_generated,
                   prompt_tokens_details=m.PromptTokensDetails(
                       cached_tokens=sum(c.output.num_cached_tokens for c in firsts)))


# Responses ------------------------------------------------------------------


def _finish(delta: TextDelta | RequestOutput) -> str | None:
    return None if delta.finish_reason is None else delta.finish_reason.value


class CompletionRenderer:
    """/v1/completions bodies: a whole response, or one chunk per text delta."""

    def __init__(self, processor: RequestProcessor, response_id: str, created: int, model: str) -> None:
        self.processor = processor
        self.head = {"id": response_id, "created": created, "model": model}

    def chunk(self, choice: Choice, delta: TextDelta) -> m.CompletionResponse:
        """`delta`, already added to `choice.output`, as a stream chunk."""
        text_offset = len(choice.output.text) - len(delta.text)
        logprobs = self._logprobs(delta.logprobs, text_offset) if choice.request.params.logprobs is not None else None
        return m.CompletionResponse(**self.head, choices=[m.CompletionChoice(
            index=choice.index, text=delta.text, logprobs=logprobs, finish_reason=_finish(delta))])

    def usage_chunk(self, choices: list[Choice]) -> m.CompletionResponse:
        return m.CompletionResponse(**self.head, choices=[], usage=usage(choices))

    def response(self, choices: list[Choice]) -> m.CompletionResponse:
        return m.CompletionResponse(**self.head, usage=usage(choices), choices=[m.CompletionChoice(
            index=c.index, text=c.output.text, finish_reason=_finish(c.output),
            logprobs=self._logprobs(c.output.logprobs, 0) if c.request.params.logprobs is not None else None)
            for c in choices])

    def _logprobs(self, logprobs: list[TokenLogprobs] | tuple[TokenLogprobs, ...],
                  text_offset: int) -> m.CompletionLogprobs:
        tokens = [self.processor.token_text(lp.token_id) for lp in logprobs]
        offsets = []
        for token in tokens:
            offsets.append(text_offset)
            text_offset += len(token)
        return m.CompletionLogprobs(
            tokens=tokens, token_logprobs=[lp.logprob for lp in logprobs], text_offset=offsets,
            top_logprobs=[{self.processor.token_text(t): v for t, v in zip(lp.top_token_ids, lp.top_logprobs)}
                          for lp in logprobs])


class ChatRenderer:
    """/v1/chat/completions bodies: a whole response, or one chunk per text delta (the first of
    each choice says role "assistant")."""

    def __init__(self, processor: RequestProcessor, response_id: str, created: int, model: str) -> None:
        self.processor = processor
        self.head = {"id": response_id, "created": created, "model": model}
        self._splitters: dict[int, ReasoningSplitter | None] = {}

    def chunk(self, choice: Choice, delta: TextDelta) -> m.ChatCompletionChunk:
        """`delta`, already added to `choice.output`, as a stream chunk; a reasoning model's
        thinking goes to `reasoning_content`."""
        first = choice.index not in self._splitters
        if first:
            self._splitters[choice.index] = self.processor.reasoning_splitter(choice.request.prompt_token_ids)
        splitter = self._splitters[choice.index]
        content, reasoning = delta.text, None
        if splitter is not None:
            part = splitter.add(delta.text, final=delta.finish_reason is not None)
            content, reasoning = part.content, part.reasoning or None
        return m.ChatCompletionChunk(**self.head, choices=[m.ChatChunkChoice(
            index=choice.index, delta=m.ChatDelta(role="assistant" if first else None, content=content,
                                                  reasoning_content=reasoning),
            logprobs=self._logprobs(choice, delta.logprobs), finish_reason=_finish(delta))])

    def usage_chunk(self, choices: list[Choice]) -> m.ChatCompletionChunk:
        return m.ChatCompletionChunk(**self.head, choices=[], usage=usage(choices))

    def response(self, choices: list[Choice]) -> m.ChatCompletionResponse:
        return m.ChatCompletionResponse(**self.head, usage=usage(choices), choices=[m.ChatChoice(
            index=c.index, message=self._message(c), logprobs=self._logprobs(c, c.output.logprobs),
            finish_reason=_finish(c.output)) for c in choices])

    def _message(self, choice: Choice) -> m.AssistantMessage:
        splitter = self.processor.reasoning_splitter(choice.request.prompt_token_ids)
        if splitter is None:
            return m.AssistantMessage(content=choice.output.text)
        part = splitter.add(choice.output.text, final=True)
        return m.AssistantMessage(content=part.content, reasoning_content=part.reasoning or None)

    def _logprobs(self, choice: Choice, logprobs: list[TokenLogprobs] | tuple[TokenLogprobs, ...]
                  ) -> m.ChatLogprobs | None:
        if choice.request.params.logprobs is None:
            return None
        return m.ChatLogprobs(content=[m.TokenLogprob(
            **self._top(lp.token_id, lp.logprob),
            top_logprobs=[m.TopLogprob(**self._top(t, v)) for t, v in zip(lp.top_token_ids, lp.top_logprobs)])
            for lp in logprobs])

    def _top(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self.processor.token_text(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}
