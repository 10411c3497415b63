"""What one worker's steps cost, as measured on a real engine: the cluster simulator's input.

A profile is a JSON file (`pdserve profile` writes one, `pdserve simulate --profile` reads it):

    {"prefill": [[prompt_tokens, seconds], ...],        # one prompt of that length, alone
     "decode": [[batch, seconds], ...],                 # one decode step at that batch size,
     "decode_context_tokens": 128,                      #   each sequence at this context
     "decode_s_per_context_token": 2e-7,                # what one more token of context adds to a step
     "kv_bytes_per_token": 55296, "kv_latency_s": 0.001, "kv_bytes_per_s": 1e9,
     "max_num_seqs": 128, "max_num_batched_tokens": 2048, "source": "...",
     "ttft_overhead_s": 0.03, "itl_overhead_s": 0.01}   # the serving path's own latency (optional)

Costs between the measured points are interpolated linearly, and extrapolated from the
nearest segment beyond them: a few measured points stand for any length or batch (the
simulator must answer for a 1,000-worker cluster from what one worker measured).
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Curve:
    """A piecewise-linear function through measured (x, y) points, x increasing."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.xs or len(self.xs) != len(self.ys):
            raise ValueError("a cost curve needs at least one (x, y) point")
        if any(b <= a for a, b in zip(self.xs, self.xs[1:])):
            raise ValueError(f"a cost curve's x values must increase, got {list(self.xs)}")
        if any(y < 0 for y in self.ys):
            raise ValueError(f"a cost curve's costs must be >= 0, got {list(self.ys)}")

    @classmethod
    def of(cls, points: list[list[float]] | list[tuple[float, float]]) -> Curve:
        pts = sorted((float(x), float(y)) for x, y in points)
        return cls(tuple(x for x, _ in pts), tuple(y for _, y in pts))

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if len(xs) == 1:  # one point: proportional to x through the origin
            return ys[0] * x / xs[0] if xs[0] else ys[0]
        i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
        slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
        return max(0.0, ys[i] + slope * (x - xs[i]))


@dataclass(frozen=True, slots=True)
class StepCosts:
    """One worker's step costs and batch limits (the engine's `SchedulerConfig`)."""

    prefill: Curve  # seconds to prefill one prompt of x tokens alone
    decode: Curve  # seconds of one decode step of x sequences at `decode_context_tokens` each
    decode_context_tokens: float = 0.0
    decode_s_per_context_token: float = 0.0
    kv_bytes_per_token: float = 0.0
    kv_latency_s: float = 0.0
    kv_bytes_per_s: float = 1e9
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    source: str = ""  # what measured it (machine, model), for the reader
    # What a served request waits besides the engine's steps, measured on a running server
    # (benchmarks/simulate.py): its way through the frontend and coordinator to a worker's
    # engine and its first token back (RPCs, the token poller, gRPC), and the same per token
    # after the first. Latency only: the workers' steps, and so their capacity, are as measured.
    ttft_overhead_s: float = 0.0
    itl_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("a profile's max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.kv_bytes_per_s <= 0:
            raise ValueError(f"a profile's kv_bytes_per_s must be > 0, got {self.kv_bytes_per_s}")
        if self.ttft_overhead_s < 0 or self.itl_overhead_s < 0:
            raise ValueError("a profile's ttft_overhead_s and itl_overhead_s must be >= 0")

    @property
    def prefill_overhead_s(self) -> float:
        """What a prefill step costs besides its tokens (the curve at 0 tokens)."""
        return self.prefill(0.0)

    def prefill_chunk_s(self, start: int, end: int) -> float:
        """Tokens start..end of one prompt, without the step's overhead: later chunks of a long
        prompt cost more (they attend to more), and a prompt's chunks sum to its whole cost."""
        return max(0.0, self.prefill(end) - self.prefill(start))

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        """One decode step of `batch` sequences holding `context_tokens` in all."""
        extra = context_tokens - batch * self.decode_context_tokens
        return max(0.0, self.decode(batch) + self.decode_s_per_context_token * extra)

    def kv_transfer_s(self, num_tokens: int) -> float:
        return self.kv_latency_s + num_tokens * self.kv_bytes_per_token / self.kv_bytes_per_s

    def to_json(self) -> dict[str, object]:
        return {"prefill": [list(p) for p in zip(self.prefill.xs, self.prefill.ys)],
                "decode": [list(p) for p in zip(self.decode.xs, self.decode.ys)],
                "decode_context_tokens": self.decode_context_tokens,
                "decode_s_per_context_token": self.decode_s_per_context_token,
                "kv_bytes_per_token": self.kv_bytes_per_token, "kv_latency_s": self.kv_latency_s,
                "kv_bytes_per_s": self.kv_bytes_per_s, "max_num_seqs": self.max_num_seqs,
                "max_num_batched_tokens": self.max_num_batched_tokens, "source": self.source,
                "ttft_overhead_s": self.ttft_overhead_s, "itl_overhead_s": self.itl_overhead_s}

    @classmethod
    def from_json(cls, data: dict[str, object]) -> StepCosts:
        fields = dict(data)
        try:
            prefill, decode = Curve.of(fields.pop("prefill")), Curve.of(fields.pop("decode"))  # type: ignore[arg-type]
            return cls(prefill, decode, **fields)  # type: ignore[arg-type]
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a step-cost profile ({type(e).__name__}: {e})") from e

    @classmethod
    def load(cls, path: str | Path) -> StepCosts:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read the profile {path}: {e}") from e
        return cls.from_json(data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")
