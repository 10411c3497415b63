"""Per-request sampling parameters."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on the output's text (structured outputs), kept by grammar-constrained
    decoding (`engine/grammar.py`).

    kind: "json_schema": JSON that follows `json_schema`; "json_object": any JSON object;
        "structural_tag": text in the shape of an xgrammar structural tag (a chat's forced tool
        calls, `engine/tools.py`).
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
    structured: the output must follow this grammar (JSON schema / any JSON object); the
        request ends (STOP) once it is complete. None: free text.
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
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
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
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {list(self.stop_token_ids)}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        # Accept lists from callers while keeping the dataclass hashable and frozen.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
