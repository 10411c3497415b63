"""The OpenAI API's bodies: requests as clients send them (validated by pydantic, fields we
cannot honour refused by name), responses and stream chunks as OpenAI's clients read them."""

from __future__ import annotations

from typing import Any, Literal

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
    user: str | None = None
    # Accepted only at their neutral values (what the engine does anyway).
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None

    def unsupported(self) -> str | None:
        """The first field set to something this server cannot do, or None."""
        if self.frequency_penalty:
            return "frequency_penalty"
        if self.presence_penalty:
            return "presence_penalty"
        if self.logit_bias:
            return "logit_bias"
        return None


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo"
        if self.suffix:
            return "suffix"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of"
        return _GenerationRequest.unsupported(self)


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # None (and no max_completion_tokens): the rest of the context
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, object]] | None = None
    # Keyword arguments for the model's chat template (vLLM's field), e.g. {"enable_thinking": false}.
    chat_template_kwargs: dict[str, object] | None = None

    def unsupported(self) -> str | None:
        if self.tools:
            return "tools"
        return _GenerationRequest.unsupported(self)


# Responses -----------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


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


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    reasoning_content: str | None = None  # a reasoning model's thinking (engine/reasoning.py)


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


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None


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
