"""The request processor: the one place where text becomes token ids and token ids text.

Every way in (the offline `Engine` API, the gRPC frontend) validates, applies the chat
template and tokenizes a request here, and turns its token deltas into text, and the text into
its answer's parts (reasoning, content, tool calls: engine/text/answer.py), through an
`OutputStream`. The engine core gets token ids and sampling params without stop strings,
and hands back token ids only; workers never detokenize.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.engine.messages import WorkerRequest
from pdserve.engine.outputs import TextDelta, TokenDelta
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.sequence import FinishReason
from pdserve.engine.text import generic_tools
from pdserve.engine.text.answer import AnswerParser
from pdserve.engine.text.detokenizer import IncrementalDetokenizer
from pdserve.engine.text.reasoning import ReasoningSplitter, opens_thinking, thinks
from pdserve.engine.text.tool_parsers import GENERIC_FORMAT, TOOL_FORMATS, ToolCallStream, ToolFormat
from pdserve.engine.text.tools import ToolRequest

logger = logging.getLogger(__name__)

CHAT_ROLES = ("system", "user", "assistant", "tool")
# apply_chat_template's own arguments: chat_template_kwargs may set the template's variables only.
_RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "add_generation_prompt", "tokenize", "tokenizer",
                                       "chat_template", "return_dict", "return_tensors", "padding", "truncation",
                                       "max_length", "continue_final_message"})


@dataclass(frozen=True, slots=True)
class ProcessedRequest:
    """A valid, tokenized request: what the engine runs, and the stop strings it never sees."""

    prompt_token_ids: tuple[int, ...]
    params: SamplingParams  # for the engine: stop strings removed
    stop: tuple[str, ...] = ()  # for the OutputStream
    tool_format: ToolFormat | None = None  # the answer's tool calls are read in it (None: all text)
    # max_tokens 0 (the prompt's log-probabilities alone, as lm-eval asks for log-likelihoods):
    # the engine runs it with max_tokens 1 (the prompt's forward samples anyway) and its
    # OutputStream drops that token, ending the request by length. See `prompt_only`.
    prompt_only: bool = False
    # Made of chat messages: the answer is the assistant's turn, a reasoning model's thinking apart
    # from its content (a raw prompt is the caller's own template: its text as generated).
    chat: bool = False

    def for_worker(self, request_id: str, num_prior_output_tokens: int = 0) -> WorkerRequest:
        """What an engine runs of this request (its stop strings stay here): the one request
        type of the engine's boundary, for the offline `Engine` and the frontends alike."""
        return WorkerRequest(request_id, self.prompt_token_ids, self.params, num_prior_output_tokens)


def prompt_only(request: ProcessedRequest) -> ProcessedRequest:
    """`request` (made with max_tokens 1) as a request for no new token (max_tokens 0)."""
    if request.params.max_tokens != 1:
        raise ValueError("a prompt-only request runs with max_tokens 1")
    return dataclasses.replace(request, prompt_only=True)


class RequestProcessor:
    """Validation, chat template and tokenization in; incremental text and stop strings out.

    tokenizer: a transformers tokenizer, or None (dummy weights: token ids in and out, no text).
    max_model_len: the context; a prompt must leave room in it for one new token.
    tool_format: the model's tool-call format (the server's --tool-call-parser): what `auto`
        tool choice parses; None: `auto` is refused, and forced calls are written in the
        Hermes format. Both for a template that renders tools only:
    generic_tools: a chat with tools (or a history of calls) on a template that renders none is
        served in the generic format (`generic_tools.py`, for any tool choice); False: refused
        (the server's --tool-format-fallback refuse).
    Every bad request raises ValueError with a message that names what is wrong.
    """

    def __init__(self, tokenizer: Any | None, model_name: str, vocab_size: int, max_model_len: int,
                 tool_format: ToolFormat | None = None, generic_tools: bool = True) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.tool_format = tool_format
        self.generic_tools = generic_tools
        self._told_generic = False  # the log says once that the generic format serves tools
        self.thinks = thinks(tokenizer)  # a reasoning model: its answers split (engine/text/reasoning.py)

    def process(self, prompt: str | Sequence[int] | None = None, messages: list[dict[str, Any]] | None = None,
                params: SamplingParams | None = None, *, token_ids_field: str = "prompt",
                chat_template_kwargs: Mapping[str, Any] | None = None,
                tools: ToolRequest | None = None, params_checked: bool = False) -> ProcessedRequest:
        """Validate and tokenize one request: a `prompt` (text or token ids) or chat `messages`
        (with `chat_template_kwargs` for the template, e.g. {"enable_thinking": False}, and the
        chat's `tools`). The one validation a request gets, where it enters (the frontends, the
        offline `Engine`): workers trust the `WorkerRequest` made of it (`WorkerRequest.check`).

        token_ids_field: what errors call a prompt given as token ids (gRPC: prompt_token_ids).
        params_checked: `params` went through `check_params` already (the gRPC frontend checks
            them first, to name their fields `sampling.*`): not again, unless tools change them.
        """
        params = params or SamplingParams()
        if (prompt is None) == (messages is None):
            raise ValueError("give one of prompt or messages")
        fmt = None
        generic = messages is not None and self._serves_generic(messages, tools)
        if tools is not None:
            fmt, forced = self._generic(tools, params) if generic else self._tools(tools, params)
            params_checked = params_checked and forced is params  # a forced choice's grammar is new
            params = forced
        if messages is not None:
            kwargs = {**(chat_template_kwargs or {}),
                      **(tools.template_kwargs() if tools is not None and not generic else {})}
            if generic:
                messages = generic_tools.generic_messages(messages, tools)
            field, token_ids = "messages", self.apply_chat_template(messages, kwargs)
        elif isinstance(prompt, str):
            field, token_ids = "prompt", self.encode(prompt)
        else:
            field, token_ids = token_ids_field, list(prompt)
        if not token_ids:
            raise ValueError(f"{field} is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"{field} has {len(token_ids)} tokens; the context is {self.max_model_len} tokens "
                             f"(prompt plus at least one new token)")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{field} has token ids {bad[:4]} outside the vocabulary [0, {self.vocab_size})")
        if not params_checked:
            self.check_params(params)
        return ProcessedRequest(tuple(token_ids), dataclasses.replace(params, stop=()), params.stop, fmt,
                                chat=messages is not None)

    def _tools(self, tools: ToolRequest, params: SamplingParams) -> tuple[ToolFormat | None, SamplingParams]:
        """The format the answer's calls are read in, and `params` with a forced choice's grammar."""
        if tools.choice == "none":
            return None, params
        if tools.choice == "auto":
            if self.tool_format is None:
                raise ValueError("tool_choice auto (the default with tools) needs the server's tool-call parser: "
                                 f"start it with --tool-call-parser ({' or '.join(TOOL_FORMATS)}), or ask for "
                                 "tool_choice required or a named function")
            return self.tool_format, params
        if params.structured is not None:
            raise ValueError(f"response_format cannot be combined with tool_choice {tools.choice}: both constrain "
                             "the answer")
        fmt = self.tool_format or TOOL_FORMATS["hermes"]
        return fmt, dataclasses.replace(params, structured=tools.structured(fmt))

    def _serves_generic(self, messages: list[dict[str, Any]], tools: ToolRequest | None) -> bool:
        """Whether this chat's tools (or its history's calls) go in the generic format: the
        template renders no tools, and the operator did not turn the fallback off."""
        template = getattr(self.tokenizer, "chat_template", None)
        if not self.generic_tools or not template or _reads_variable(template, "tools"):
            return False
        if tools is None and not any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
            return False
        if not self._told_generic:
            self._told_generic = True
            logger.info("the chat template of model %r renders no tools: chats with tools are served in the "
                        "generic tool format (--tool-format-fallback refuse turns it off)", self.model_name)
        return True

    def _generic(self, tools: ToolRequest, params: SamplingParams) -> tuple[ToolFormat | None, SamplingParams]:
        """The generic format and its grammar, a call or (auto) a reply (`generic_tools.py`)."""
        if tools.choice == "none" or not tools.functions:
            return None, params
        if params.structured is not None:
            raise ValueError("response_format cannot be combined with tools on a model whose chat template "
                             "renders none: the generic tool format constrains the answer")
        return GENERIC_FORMAT, dataclasses.replace(params, structured=generic_tools.structured(tools))

    def check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: stop token ids, logit_bias ids, stop strings and grammars,
        for this model."""
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids: unknown stop token ids {bad} (vocabulary size {self.vocab_size})")
        bad = [t for t, _ in params.logit_bias if t >= self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias: token ids {bad[:4]} outside the vocabulary [0, {self.vocab_size})")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop strings need a tokenizer; model {self.model_name!r} has none")
        if params.structured is not None:
            if self.tokenizer is None:
                raise ValueError(f"response_format needs a tokenizer; model {self.model_name!r} has none")
            from pdserve.engine.grammar import check_structured  # here: grammar.py (xgrammar) needs torch

            check_structured(params.structured)

    def encode(self, prompt: str) -> list[int]:
        tokenizer = self._tokenizer()
        if not prompt:
            raise ValueError("prompt is empty")
        return tokenizer.encode(prompt)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """The token ids of `messages` in the model's chat template, ready for the assistant's
        turn; `template_kwargs` are the template's own variables (ValueError for one that
        would change how it is applied; `tools` only for a template that renders them)."""
        if not messages:
            raise ValueError("messages is empty")
        roles = {m.get("role", "") for m in messages} - set(CHAT_ROLES)
        if roles:
            raise ValueError(f"messages has unknown roles {sorted(roles)}; use system, user, assistant or tool")
        tokenizer = self._tokenizer()
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"model {self.model_name!r} has no chat template")
        kwargs = dict(template_kwargs or {})
        reserved = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {reserved}: the server applies the template")
        self._check_renders_tools(tokenizer.chat_template, messages, bool(kwargs.get("tools")))
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        return tokenizer.encode(text, add_special_tokens=False)

    def _check_renders_tools(self, template: str, messages: list[dict[str, Any]], has_tools: bool) -> None:
        """A template that never reads `tools` (or `tool_calls`) would drop them in silence:
        refuse the request, naming what to do (a tool-capable template: --chat-template)."""
        fix = "start the server with --chat-template PATH, a Jinja chat template that renders tools"
        if has_tools and not _reads_variable(template, "tools"):
            raise ValueError(f"tools: the chat template of model {self.model_name!r} does not render tools; {fix}")
        for i, message in enumerate(messages):
            if message.get("tool_calls") and "tool_calls" not in template:
                raise ValueError(f"messages[{i}].tool_calls: the chat template of model {self.model_name!r} does "
                                 f"not render tool calls; {fix}")

    def reasoning_splitter(self, prompt_token_ids: Sequence[int]) -> ReasoningSplitter | None:
        """A splitter of one answer into reasoning and content, for a reasoning model (None:
        all content); it starts inside the reasoning when the prompt leaves a <think> open."""
        if not self.thinks:
            return None
        return ReasoningSplitter(opens_thinking(self.tokenizer.decode(list(prompt_token_ids[-16:]))))

    def token_text(self, token_id: int) -> str:
        """One token's own text (as logprobs show it); without a tokenizer, "token_id:<id>"."""
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of token ids (an echoed prompt); without a tokenizer, their `token_text`s."""
        if self.tokenizer is None:
            return "".join(self.token_text(t) for t in token_ids)
        return self.tokenizer.decode(list(token_ids))

    def output_stream(self, request: ProcessedRequest) -> OutputStream:
        splitter = self.reasoning_splitter(request.prompt_token_ids) if request.chat else None
        tool_calls = ToolCallStream(request.tool_format) if request.tool_format is not None else None
        return OutputStream(self.tokenizer, request.prompt_token_ids, request.stop, request.prompt_only,
                            AnswerParser(splitter, tool_calls))

    def _tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError(f"model {self.model_name!r} has no tokenizer: send token ids")
        return self.tokenizer


def _reads_variable(template: str, name: str) -> bool:
    """Whether a Jinja template reads variable `name` from its caller (jinja2 ships with
    transformers); a template that uses an extension jinja2 alone lacks: whether it names it."""
    import jinja2
    import jinja2.meta

    try:
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError:
        return name in template
    return name in jinja2.meta.find_undeclared_variables(ast)


class OutputStream:
    """One request's text as its token deltas arrive: incremental detokenization, stop strings,
    and the text's answer parts (`TextDelta.answer`), which every API renders as they are.

    Text that could still begin a stop string is held back until it cannot (or the request
    ends). A delta that completes a stop string comes back cut (see `TextDelta`) with
    finish_reason STOP while the engine still runs the request: the caller aborts it. An
    answer that made tool calls and stopped ends with TOOL_CALLS instead of STOP (one cut by
    its length keeps LENGTH: its last call may be missing).
    prompt_only: the request's one token is dropped (`ProcessedRequest.prompt_only`).
    answer: the answer's parser (None: all content).
    """

    def __init__(self, tokenizer: Any | None, prompt_token_ids: Sequence[int], stop: tuple[str, ...],
                 prompt_only: bool = False, answer: AnswerParser | None = None) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, stop) if tokenizer is not None else None
        self._prompt_only = prompt_only
        self._answer = answer if answer is not None else AnswerParser()

    def add(self, delta: TokenDelta) -> TextDelta:
        if self._prompt_only:
            return TextDelta(delta.request_id, (), "", FinishReason.LENGTH, (), delta.num_cached_tokens,
                             delta.prompt_logprobs)
        token_ids, reason = delta.token_ids, delta.finish_reason
        text = ""
        if self._detokenizer is not None:
            for i, token_id in enumerate(token_ids):
                if self._detokenizer.add(token_id):
                    token_ids, reason = token_ids[:i + 1], FinishReason.STOP
                    break
            text = self._detokenizer.take_delta(reason is not None)
        answer = self._answer.add(text, final=reason is not None)
        if reason is FinishReason.STOP and answer.num_tool_calls:
            reason = FinishReason.TOOL_CALLS
        return TextDelta(delta.request_id, token_ids, text, reason, delta.logprobs[:len(token_ids)],
                         delta.num_cached_tokens, delta.prompt_logprobs, answer)
