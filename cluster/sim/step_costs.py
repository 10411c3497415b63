"""What one worker's steps cost, as measured on a real engine: the cluster simulator's input.

A profile is a JSON file (`pdserve profile` writes one, `pdserve simulate --profile` reads it):

    {"prefill": [[prompt_tokens, seconds], ...],        # one prompt of that length, alone
     "decode": [[batch, seconds], ...],                 # one decode step at that batch size,
     "decode_context_tokens": 128,                      #   each sequence at this context
     "decode_s_per_context_token": 2e-7,                # what one more token of context adds to a step
     "kv_bytes_per_token": 55296, "kv_latency_s": 0.001, "kv_bytes_per_s": 1e9,
     "max_num_seqs": 128, "max_num_batched_tokens": 2048, "source": "...",
     "ttft_overhead_s": 0.03, "itl_overhead_s": 0.01,   # the serving path's own latency (optional):
     "colocated_ttft_overhead_s": 0.09,                 #   disaggregated, and colocated (optional;
     "colocated_itl_overhead_s": 0.01}                  #   absent: the disaggregated ones)

Costs between the measured points are interpolated linearly, and extrapolated from the
nearest segment beyond them: a few measured points stand for any length or batch (the
simulator must answer for a 1,000-worker cluster from what one worker measured).
"""

from __future__ import annotations

import bisect
import dataclasses
import json
from collections.abc import Sequence
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
    # Each setup has its own path (disaggregated: the decode reservation and the KV handshake;
    # colocated: no KV hop, but its first token comes through the token poller, not as the
    # prefill call's reply, and one engine loop runs both phases), so each its own figures; a
    # profile of before they were split (one pair, measured on 1P+1D) sets only the first two,
    # and colocated splits take those, as they always did.
    ttft_overhead_s: float = 0.0  # disaggregated
    itl_overhead_s: float = 0.0
    colocated_ttft_overhead_s: float | None = None  # None: ttft_overhead_s
    colocated_itl_overhead_s: float | None = None  # None: itl_overhead_s

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("a profile's max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.kv_bytes_per_s <= 0:
            raise ValueError(f"a profile's kv_bytes_per_s must be > 0, got {self.kv_bytes_per_s}")
        for name in ("ttft_overhead_s", "itl_overhead_s", "colocated_ttft_overhead_s", "colocated_itl_overhead_s"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"a profile's {name} must be >= 0, got {value}")

    def overheads_s(self, colocated: bool) -> tuple[float, float]:
        """The serving path's (TTFT, ITL) overheads of a setup: disaggregated or colocated."""
        if not colocated:
            return self.ttft_overhead_s, self.itl_overhead_s
        ttft, itl = self.colocated_ttft_overhead_s, self.colocated_itl_overhead_s
        return (self.ttft_overhead_s if ttft is None else ttft, self.itl_overhead_s if itl is None else itl)

    @property
    def prefill_overhead_s(self) -> float:
        """What a prefill step costs besides its tokens (the curve at 0 tokens)."""
        return self.prefill(0.0)

    def with_overheads(self, colocated: bool, ttft_s: float, itl_s: float) -> StepCosts:
        """These costs with one setup's serving overheads set (the other setup's kept)."""
        if colocated:
            return dataclasses.replace(self, colocated_ttft_overhead_s=ttft_s, colocated_itl_overhead_s=itl_s)
        return dataclasses.replace(self, ttft_overhead_s=ttft_s, itl_overhead_s=itl_s)

    def engine_only(self) -> StepCosts:
        """These costs without any serving overhead: what a calibration compares a server against."""
        return dataclasses.replace(self, ttft_overhead_s=0.0, itl_overhead_s=0.0, colocated_ttft_overhead_s=0.0,
                                   colocated_itl_overhead_s=0.0)

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
                "ttft_overhead_s": self.ttft_overhead_s, "itl_overhead_s": self.itl_overhead_s,
                "colocated_ttft_overhead_s": self.colocated_ttft_overhead_s,
                "colocated_itl_overhead_s": self.colocated_itl_overhead_s}

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


def least_overheads_s(measured_ms: Sequence[tuple[float, float]],
                      predicted_ms: tuple[float, float]) -> tuple[float, float]:
    """The serving path's (TTFT, ITL) overheads, seconds, from calibration runs: each run's
    measured (TTFT, ITL) ms of requests sent one at a time, against the engine-only prediction
    for them. The least run of each figure, as the profiler keeps the least of its runs: on a
    shared machine the others' load only ever adds, and one noisy moment must not stand for
    the serving path. Never below 0 (a run quicker than the profile is the profile's noise)."""
    if not measured_ms:
        raise ValueError("the serving overheads need at least one calibration run")
    ttft_ms = min(t for t, _ in measured_ms) - predicted_ms[0]
    itl_ms = min(i for _, i in measured_ms) - predicted_ms[1]
    return max(0.0, ttft_ms / 1e3), max(0.0, itl_ms / 1e3)
