"""The OpenAI API's bodies: requests as clients send them (validated by pydantic, fields we
cannot honour refused by name), responses and stream chunks as OpenAI's clients read them."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from pdserve.engine.sampling import StructuredOutput

_INT64 = 2**63


class _Body(BaseModel):
    # Unknown fields are ignored, as OpenAI-compatible servers do; NaN and infinities are refused.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    """OpenAI's `response_format.json_schema`: the schema is `schema` (vLLM also reads it as `json_schema`)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None  # the output always follows the schema, strict or not


class ResponseFormat(_Body):
    """Structured outputs: `json_schema` (JSON that follows a schema) or `json_object` (any JSON object)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None

    def structured(self) -> StructuredOutput | None:
        """What the engine keeps to (None: free text); ValueError naming what is missing."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutput("json_object")
        if self.json_schema is None or self.json_schema.json_schema is None:
            raise ValueError("response_format: type json_schema needs json_schema.schema")
        return StructuredOutput.from_schema(self.json_schema.json_schema)


class _GenerationRequest(_Body):
    """What completions and chat completions share."""

    model: str | None = None  # None: the model this server serves
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(None, ge=-_INT64, lt=_INT64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    response_format: ResponseFormat | None = None
    # Accepted and ignored: they change nothing a self-hosted server returns.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # Penalties and bias (engine/penalties.py); ranges are SamplingParams' (a 400 naming the field).
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as JSON keys are strings) -> bias
    repetition_penalty: float | None = None  # vLLM's (HF's definition)
    min_tokens: int | None = None  # vLLM's
    # vLLM's: each prompt token's log-probability, rank and this many top alternatives (completions).
    prompt_logprobs: int | None = None
    cache_salt: str | None = None  # vLLM's: only requests with the same salt share cached prefixes
    # vLLM's: who goes first where requests wait, lower first (SamplingParams.priority). Strict:
    # "1" or 1.0 is no priority, a 400 naming the field.
    priority: int = Field(0, strict=True, ge=-_INT64, lt=_INT64)

    # Each field that is accepted only at one of its neutral values (what the engine does
    # anyway), and those values: any other value is refused by name (`unsupported`), never
    # dropped in silence.
    NEUTRAL_ONLY: ClassVar[dict[str, tuple[Any, ...]]] = {}

    def unsupported(self) -> str | None:
        """The first field set to something this server cannot do, or None."""
        return next((name for name, neutral in self.NEUTRAL_ONLY.items() if getattr(self, name) not in neutral), None)


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # 0 only with echo: the prompt alone (how lm-eval asks for log-likelihoods)
    logprobs: int | None = None
    echo: bool = False  # the prompt before the completion, in the text and the logprobs
    suffix: str | None = None
    best_of: int | None = None

    NEUTRAL_ONLY = {**_GenerationRequest.NEUTRAL_ONLY, "suffix": (None, "")}

    def unsupported(self) -> str | None:
        if self.best_of is not None and self.best_of != self.n:
            return "best_of"
        return _GenerationRequest.unsupported(self)


class ContentPart(_Body):
    type: str
    text: str | None = None


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON object text, as OpenAI sends it


class ToolCallIn(_Body):
    """A call an earlier assistant turn made (the history of a tool-using chat)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # None (and no max_completion_tokens): the rest of the context
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # Keyword arguments for the model's chat template (vLLM's field), e.g. {"enable_thinking": false}.
    chat_template_kwargs: dict[str, object] | None = None
    # Tool calling (engine/text/tools.py): functions, none / auto (the default with tools) / required /
    # {"type": "function", "function": {"name": ...}}, and whether one answer may call several.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    prompt_cache_options: dict[str, object] | None = None  # the prefix cache keeps what it can, always
    prompt_cache_retention: str | None = None
    # Accepted only at their neutral values, as above.
    functions: list[dict[str, object]] | None = None  # the deprecated form of tools
    function_call: str | dict[str, object] | None = None
    modalities: list[str] | None = None
    audio: dict[str, object] | None = None
    prediction: dict[str, object] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, object] | None = None
    moderation: dict[str, object] | None = None
    echo: bool = False  # vLLM's (the last message echoed): not here

    NEUTRAL_ONLY = {**_GenerationRequest.NEUTRAL_ONLY, "prompt_logprobs": (None,), "echo": (False,),
                    "functions": (None, []), "function_call": (None, "none"),
                    "modalities": (None, ["text"]),
                    "audio": (None,), "prediction": (None,), "reasoning_effort": (None,), "verbosity": (None,),
                    "web_search_options": (None,), "moderation": (None,)}


# Responses -----------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy logprobs; with echo the prompt's tokens come first, the first one's
    log-probability and alternatives null."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    """vLLM's entry of `prompt_logprobs` (keyed by token id)."""

    logprob: float
    rank: int
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # vLLM's, with prompt_logprobs: null for the first prompt token, then {token id: entry} of
    # the prompt's token and its top alternatives.
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None


class CompletionResponse(BaseModel):
    """A whole completion, and (object the same, as OpenAI streams them) each stream chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON object text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None: the answer was only tool calls
    reasoning_content: str | None = None  # a reasoning model's thinking (engine/text/reasoning.py)
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionDeltaOut(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDeltaOut(BaseModel):
    """A call in stream chunks, as OpenAI streams them: its index, id, type and name first
    (arguments ""), then its arguments under the same index."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDeltaOut


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDeltaOut] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pdserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
