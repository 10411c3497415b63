"""OpenAI bodies <-> pdserve: a request becomes its choices (one `ProcessedRequest` each,
validated by the request processor), and choices' text deltas become OpenAI's responses
and stream chunks (completions and chat completions)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdserve.cluster.api import openai_models as m
from pdserve.engine.outputs import RequestOutput, TextDelta
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.text.request_processor import ProcessedRequest, RequestProcessor, prompt_only
from pdserve.engine.text.tools import tool_request

if TYPE_CHECKING:  # annotations only: the sampler imports torch, which the HTTP path does not need
    from pdserve.engine.sampler import TokenLogprobs


@dataclass(slots=True)
class Choice:
    """One generated sequence of an API call: choice `index`, sample `sample` of prompt `prompt_index`."""

    index: int
    prompt_index: int
    sample: int
    request: ProcessedRequest
    echo: bool = False  # completions' echo: the prompt comes first in the text and the logprobs
    output: RequestOutput = field(init=False)

    def __post_init__(self) -> None:
        self.output = RequestOutput(str(self.index), self.request.prompt_token_ids)


# Requests -------------------------------------------------------------------


def completion_choices(req: m.CompletionRequest, processor: RequestProcessor) -> list[Choice]:
    """Raises ValueError naming the bad field. With echo and logprobs the prompt's tokens get
    theirs (`prompt_logprobs`, at least `logprobs` alternatives); max_tokens 0 (echo only)
    runs with 1 and drops its token (`prompt_only`)."""
    prompts = _prompts(req.prompt)
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    if max_tokens == 0 and not req.echo:
        raise ValueError("max_tokens must be >= 1 (0 only with echo), got 0")
    params = _sampling(req, 1 if max_tokens == 0 else max_tokens, req.logprobs)
    if req.echo and req.logprobs is not None:
        params = dataclasses.replace(params, prompt_logprobs=max(req.logprobs, req.prompt_logprobs or 0))
    requests = [processor.process(p, params=params) for p in prompts]
    if max_tokens == 0:
        requests = [prompt_only(r) for r in requests]
    return _expand(requests, req.n, req.echo)


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
    tools = tool_request(req.tools, req.tool_choice, req.parallel_tool_calls)
    processed = processor.process(messages=[_message(i, msg) for i, msg in enumerate(req.messages)], params=params,
                                  chat_template_kwargs=req.chat_template_kwargs, tools=tools)
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


def _message(i: int, msg: m.ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it: text content ("" for none: templates concatenate it),
    an assistant turn's calls with their arguments as objects (transformers' form, which
    templates write with `tojson`), a tool turn's call id."""
    role = "system" if msg.role == "developer" else msg.role
    message: dict[str, Any] = {"role": role, "content": _text(i, msg)}
    if msg.tool_calls:
        if role != "assistant":
            raise ValueError(f"messages[{i}].tool_calls: only an assistant message carries tool calls")
        message["tool_calls"] = [_history_call(i, j, call) for j, call in enumerate(msg.tool_calls)]
    if msg.tool_call_id is not None:
        message["tool_call_id"] = msg.tool_call_id
    if msg.name is not None:
        message["name"] = msg.name
    return message


def _text(i: int, msg: m.ChatMessage) -> str:
    if msg.content is None or isinstance(msg.content, str):
        return msg.content or ""
    parts = []
    for part in msg.content:
        if part.type != "text" or part.text is None:
            raise ValueError(f"messages[{i}].content: only text parts are supported, got {part.type!r}")
        parts.append(part.text)
    return "".join(parts)


def _history_call(i: int, j: int, call: m.ToolCallIn) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError as e:
        raise ValueError(f"messages[{i}].tool_calls[{j}].function.arguments is not JSON: {e}") from e
    if not isinstance(arguments, dict):
        raise ValueError(f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object")
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


# The request fields that are SamplingParams' own, taken as they are when set.
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "logit_bias", "min_tokens", "cache_salt", "priority")


def _sampling(req: m.CompletionRequest | m.ChatCompletionRequest, max_tokens: int,
              logprobs: int | None) -> SamplingParams:
    kwargs: dict[str, Any] = {name: getattr(req, name) for name in _SAMPLING_FIELDS if getattr(req, name) is not None}
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    structured = req.response_format.structured() if req.response_format is not None else None
    return SamplingParams(**kwargs, max_tokens=max_tokens, stop=stop, stop_token_ids=tuple(req.stop_token_ids or ()),
                          ignore_eos=req.ignore_eos, logprobs=logprobs, prompt_logprobs=req.prompt_logprobs,
                          structured=structured)


def _expand(requests: list[ProcessedRequest], n: int, echo: bool = False) -> list[Choice]:
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
            choices.append(Choice(len(choices), p, i, sample, echo))
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
    """OpenAI's finish_reason, "tool_calls" included (the `OutputStream` says when)."""
    return None if delta.finish_reason is None else delta.finish_reason.value


class CompletionRenderer:
    """/v1/completions bodies: a whole response, or one chunk per text delta (with echo, the
    first chunk of a choice starts with the prompt, and its tokens' logprobs)."""

    def __init__(self, processor: RequestProcessor, response_id: str, created: int, model: str) -> None:
        self.processor = processor
        self.head = {"id": response_id, "created": created, "model": model}
        self._echoed: dict[int, int] = {}  # choice index -> its echoed prompt's text length

    def chunks(self, choice: Choice, delta: TextDelta) -> list[m.CompletionResponse]:
        """`delta`, already added to `choice.output`, as a stream chunk."""
        prompt_text, token_ids, entries = "", [lp.token_id for lp in delta.logprobs], list(delta.logprobs)
        if choice.echo and choice.index not in self._echoed:
            prompt_text = self.processor.decode(choice.request.prompt_token_ids)
            self._echoed[choice.index] = len(prompt_text)
            token_ids = [*choice.request.prompt_token_ids, *token_ids]
            entries = [*delta.prompt_logprobs, *entries]
        text_offset = len(choice.output.text) - len(delta.text)
        if choice.echo and not prompt_text:
            text_offset += self._echoed[choice.index]
        logprobs = prompt_logprobs = None
        if choice.request.params.logprobs is not None:
            logprobs = self._logprobs(token_ids, entries, text_offset, choice.request.params.logprobs)
        num_prompt_top = choice.request.params.prompt_logprobs
        if num_prompt_top is not None and delta.prompt_logprobs:  # the first chunk, as vLLM streams them
            prompt_logprobs = self._prompt_logprobs(delta.prompt_logprobs, num_prompt_top)
        return [m.CompletionResponse(**self.head, choices=[m.CompletionChoice(
            index=choice.index, text=prompt_text + delta.text, logprobs=logprobs, finish_reason=_finish(delta),
            prompt_logprobs=prompt_logprobs)])]

    def usage_chunk(self, choices: list[Choice]) -> m.CompletionResponse:
        return m.CompletionResponse(**self.head, choices=[], usage=usage(choices))

    def response(self, choices: list[Choice]) -> m.CompletionResponse:
        return m.CompletionResponse(**self.head, usage=usage(choices), choices=[self._choice(c) for c in choices])

    def _choice(self, c: Choice) -> m.CompletionChoice:
        """A whole choice; with echo, the prompt (and its tokens' logprobs) before the completion."""
        num_top = c.request.params.logprobs
        prompt_text = self.processor.decode(c.request.prompt_token_ids) if c.echo else ""
        logprobs = None
        if num_top is not None:
            token_ids = [*c.request.prompt_token_ids, *c.output.token_ids] if c.echo else c.output.token_ids
            entries = [*c.output.prompt_logprobs, *c.output.logprobs] if c.echo else c.output.logprobs
            logprobs = self._logprobs(token_ids, entries, 0, num_top)
        prompt_logprobs = None
        if c.request.params.prompt_logprobs is not None and c.output.prompt_logprobs:
            prompt_logprobs = self._prompt_logprobs(c.output.prompt_logprobs, c.request.params.prompt_logprobs)
        return m.CompletionChoice(index=c.index, text=prompt_text + c.output.text, finish_reason=_finish(c.output),
                                  logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    def _logprobs(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs | None], text_offset: int,
                  num_top: int | None = None) -> m.CompletionLogprobs:
        """OpenAI's legacy form of `token_ids` and their entries: one with no log-probability (an
        echoed prompt's first token) is null; `num_top` bounds the alternatives (a prompt's may
        have more: vLLM's prompt_logprobs asked for beside)."""
        assert len(token_ids) == len(logprobs), "a log-probability entry for every token"
        tokens = [self.processor.token_text(t) for t in token_ids]
        offsets = []
        for token in tokens:
            offsets.append(text_offset)
            text_offset += len(token)
        return m.CompletionLogprobs(
            tokens=tokens, token_logprobs=[lp.logprob if lp is not None else None for lp in logprobs],
            text_offset=offsets,
            top_logprobs=[None if lp is None else {self.processor.token_text(t): v for t, v in zip(
                lp.top_token_ids[:num_top], lp.top_logprobs[:num_top])} for lp in logprobs])

    def _prompt_logprobs(self, entries: Sequence[TokenLogprobs | None], num_top: int
                         ) -> list[dict[int, m.PromptLogprob] | None]:
        """vLLM's form: {token id: logprob, rank, decoded token} of the prompt's token and its top alternatives."""
        out: list[dict[int, m.PromptLogprob] | None] = []
        for lp in entries:
            if lp is None:
                out.append(None)
                continue
            ranked = {lp.token_id: m.PromptLogprob(logprob=lp.logprob, rank=lp.rank,
                                                   decoded_token=self.processor.token_text(lp.token_id))}
            for rank, (t, v) in enumerate(zip(lp.top_token_ids[:num_top], lp.top_logprobs[:num_top]), start=1):
                ranked.setdefault(t, m.PromptLogprob(logprob=v, rank=rank, decoded_token=self.processor.token_text(t)))
            out.append(ranked)
        return out


class ChatRenderer:
    """/v1/chat/completions bodies: a whole response, or stream chunks for each text delta (the
    first of each choice says role "assistant"), rendered from the answer's parts that the
    request's `OutputStream` parsed (`TextDelta.answer`, `RequestOutput`): a reasoning model's
    thinking in `reasoning_content`; with tools, the calls the answer made in `tool_calls`."""

    def __init__(self, processor: RequestProcessor, response_id: str, created: int, model: str) -> None:
        self.processor = processor
        self.head = {"id": response_id, "created": created, "model": model}
        self._started: set[int] = set()  # the choices whose first chunk is out

    def chunks(self, choice: Choice, delta: TextDelta) -> list[m.ChatCompletionChunk]:
        """`delta`, already added to `choice.output`, as stream chunks: its content, then each call
        it completes (its id and name, then its arguments); finish_reason on the last."""
        first = choice.index not in self._started
        self._started.add(choice.index)
        answer = delta.answer
        deltas = [m.ChatDelta(role="assistant" if first else None, content=answer.content,
                              reasoning_content=answer.reasoning or None)]
        index = answer.num_tool_calls - len(answer.tool_calls)
        for i, call in enumerate(answer.tool_calls, index):
            deltas.append(m.ChatDelta(tool_calls=[m.ToolCallDeltaOut(
                index=i, id=call.id, type="function", function=m.FunctionDeltaOut(name=call.name, arguments=""))]))
            deltas.append(m.ChatDelta(tool_calls=[m.ToolCallDeltaOut(
                index=i, function=m.FunctionDeltaOut(arguments=call.arguments))]))
        finish = _finish(delta)
        logprobs = self._logprobs(choice, delta.logprobs)
        return [m.ChatCompletionChunk(**self.head, choices=[m.ChatChunkChoice(
            index=choice.index, delta=d, logprobs=logprobs if i == 0 else None,
            finish_reason=finish if i == len(deltas) - 1 else None)]) for i, d in enumerate(deltas)]

    def usage_chunk(self, choices: list[Choice]) -> m.ChatCompletionChunk:
        return m.ChatCompletionChunk(**self.head, choices=[], usage=usage(choices))

    def response(self, choices: list[Choice]) -> m.ChatCompletionResponse:
        body = []
        for c in choices:
            message = self._message(c)
            body.append(m.ChatChoice(index=c.index, message=message, logprobs=self._logprobs(c, c.output.logprobs),
                                     finish_reason=_finish(c.output)))
        return m.ChatCompletionResponse(**self.head, usage=usage(choices), choices=body)

    @staticmethod
    def _message(choice: Choice) -> m.AssistantMessage:
        """The whole answer; beside calls, content that is only blanks is none."""
        out, reasoning = choice.output, choice.output.reasoning or None
        if not out.tool_calls:
            return m.AssistantMessage(content=out.content, reasoning_content=reasoning)
        return m.AssistantMessage(content=out.content.strip() or None, reasoning_content=reasoning,
                                  tool_calls=[m.ToolCallOut(id=c.id, function=m.FunctionCallOut(
                                      name=c.name, arguments=c.arguments)) for c in out.tool_calls])

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
