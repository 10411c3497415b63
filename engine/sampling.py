"""Per-request sampling parameters."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

# The most alternatives a request may ask for per token, sampled or prompt (vLLM's default
# max_logprobs): each costs a top-k over the vocabulary and a host copy.
MAX_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on the output's text (structured outputs), kept by grammar-constrained
    decoding (`engine/grammar.py`).

    kind: "json_schema": JSON that follows `json_schema`; "json_object": any JSON object;
        "structural_tag": text in the shape of an xgrammar structural tag (a chat's forced tool
        calls, `engine/text/tools.py`).
    json_schema: the schema as compact JSON text, member order kept (the output follows it;
        the grammar cache's key); "" for the other kinds.
    structural_tag: the structural tag as JSON text; "" for the other kinds.
    Checked against the grammar library by the request processor, not here.
    """

    kind: Literal["json_schema", "json_object", "structural_tag"]
    json_schema: str = ""
    structural_tag: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("json_schema", "json_object", "structural_tag"):
            raise ValueError(f"response_format: unknown type {self.kind!r}; use json_schema or json_object")
        if (self.kind == "json_schema") != bool(self.json_schema):
            raise ValueError("response_format: json_schema needs a schema (and json_object takes none)")
        if (self.kind == "structural_tag") != bool(self.structural_tag):
            raise ValueError("a structural_tag constraint needs its tag (and the other kinds take none)")

    @classmethod
    def from_schema(cls, schema: object) -> StructuredOutput:
        """A json_schema constraint from a schema given as JSON text or as parsed JSON."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"response_format: the JSON schema is not valid JSON: {e}") from e
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"response_format: a JSON schema is an object or a boolean, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema, separators=(",", ":")))


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature: 0 is greedy; > 0 scales logits.
    top_k: keep the k most likely tokens; -1 (or 0) keeps all.
    top_p: keep the smallest set whose probability reaches top_p; 1 keeps all.
    min_p: drop tokens less likely than min_p * p(most likely token).
    seed: per-request seed; the same seed gives the same tokens whatever else
        is in the batch and whichever workers sample them (draws are keyed by
        (seed, output index): `engine.sampler.keyed_seed`).
    max_tokens: new tokens to generate at most.
    stop_token_ids: extra token ids that end generation (the model's EOS always does
        unless ignore_eos).
    stop: strings that end generation; the text is cut before the stop string.
    logprobs: also return the log-probability of each sampled token and this many
        of the most likely alternatives (None: none).
    prompt_logprobs: also return the log-probability of each prompt token after the first
        (under the tokens before it) and this many of the most likely alternatives (None:
        none; vLLM's). Such a request computes its whole prompt: a prefix-cache hit has KV but
        no logits (`Engine`, `engine/prompt_logprobs.py`).
    structured: the output must follow this grammar (JSON schema / any JSON object); the
        request ends (STOP) once it is complete. None: free text.
    presence_penalty, frequency_penalty: OpenAI's, in [-2, 2]: a token's logit is lowered by
        presence_penalty once it occurs in the output so far, and by frequency_penalty for
        each time it occurs there (the prompt does not count).
    repetition_penalty: Hugging Face's (CTRL's), > 0: the logit of every token in the prompt
        or the output is divided by it when positive, multiplied by it otherwise; 1 is off.
    logit_bias: (token id, bias in [-100, 100]) pairs added to those tokens' logits
        (OpenAI's); a dict is taken too. The request processor checks the ids against the
        vocabulary.
    min_tokens: EOS and the stop token ids cannot be sampled before this many tokens were
        generated (vLLM's); a client's at most its max_tokens (`check_min_tokens`).
    cache_salt: seeds the hash of the request's first KV block (vLLM's `cache_salt`), so
        that only requests with the same salt share cached prefixes (tenants who must not
        learn of each other's prompts through cache timing); None shares with unsalted ones.
    priority: who goes first where requests wait (vLLM's; lower first, any integer): the
        frontend's admission and the engines' schedulers (`SchedulerConfig.policy`). It changes
        no token.
    tenant, tenant_weight: whose request it is and that tenant's weight in the fair share of
        the engines' seats (`engine/tenant_share.py`: among waiting sequences of one priority,
        the tenant running the fewest for its weight goes first). The frontend sets them from
        the operator's tenants file; every frontend's requests meet in the engines, so the
        share holds across frontends. They change no token.
    The penalties and the bias change what is sampled, not the log-probabilities returned
    (the model's own, as vLLM's default); `engine/penalties.py` applies them on the device.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: StructuredOutput | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    cache_salt: str | None = None
    priority: int = 0
    tenant: str = ""
    tenant_weight: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.tenant_weight, bool) or not isinstance(self.tenant_weight, (int, float)) \
                or not 0 < self.tenant_weight < float("inf"):
            raise ValueError(f"tenant_weight must be a number > 0, got {self.tenant_weight!r}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"priority must be an integer, got {self.priority!r}")
        if self.cache_salt is not None and not 0 < len(self.cache_salt) <= 1024:
            raise ValueError(f"cache_salt must be 1 to 1024 characters, got {len(self.cache_salt)}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {list(self.stop_token_ids)}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            bias = tuple(sorted((int(token_id), float(value)) for token_id, value in bias))
        except (TypeError, ValueError) as e:
            raise ValueError(f"logit_bias: token ids and biases must be numbers: {e}") from e
        bad = [(t, v) for t, v in bias if t < 0 or not -100.0 <= v <= 100.0]
        if bad:
            raise ValueError(f"logit_bias: token ids must be >= 0 and biases in [-100, 100], got {dict(bad[:4])}")
        if len({t for t, _ in bias}) < len(bias):
            raise ValueError("logit_bias: a token id is given twice")
        # Accept lists (and a dict of biases) from callers while keeping the dataclass hashable and frozen.
        object.__setattr__(self, "logit_bias", bias)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check_min_tokens(self) -> None:
        """A client's request asks for at most max_tokens tokens at least. Checked where requests
        come in (the frontends), not on construction: the prefill worker's share of a request
        (max_tokens 1) and a migrated request's rest keep its min_tokens, which counts from its
        first output token (`Sequence.next_output_index`)."""
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")

    @property
    def penalized(self) -> bool:
        """Whether a penalty, a bias or min_tokens changes this request's logits (a batch
        where no row is pays nothing for them)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)
