"""Service-level objectives: the one `Slo` the simulator, the planner and `pdserve bench`'s
goodput count requests against."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Slo:
    """A request meets its objectives when it is within every one that is set, ms: its time to
    first token, its mean gap between tokens after the first (TPOT: the mean ITL), its
    end-to-end latency."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @classmethod
    def parse(cls, items: list[str]) -> Slo:
        """From `ttft:500 tpot:50` (vllm bench serve's --goodput)."""
        values: dict[str, float] = {}
        for item in items:
            name, _, value = item.partition(":")
            if name not in ("ttft", "tpot", "e2el") or not value:
                raise ValueError(f"goodput objective must be ttft:MS, tpot:MS or e2el:MS, got {item!r}")
            values[f"{name}_ms"] = float(value)
        return cls(**values)

    @property
    def is_set(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms))

    def met_by(self, ttft_s: float, tpot_s: float | None, e2el_s: float | None = None) -> bool:
        """Whether a request of these latencies (seconds; a TPOT of None: one token, no gap)
        meets every objective that is set."""
        return (_within(ttft_s, self.ttft_ms) and (tpot_s is None or _within(tpot_s, self.tpot_ms))
                and (e2el_s is None or _within(e2el_s, self.e2el_ms)))


def _within(seconds: float, limit_ms: float | None) -> bool:
    return limit_ms is None or seconds * 1e3 <= limit_ms
