"""How many tokens to propose: the expected-speedup model, and per-request adaptive K.

With a per-token acceptance rate α, the target keeps x_1..x_n (n < K) with
probability α^n (1 - α) and all K with probability α^K, and always adds one
token of its own, so the expected tokens per target pass is
    1 + α + α^2 + ... + α^K = (1 - α^(K+1)) / (1 - α).
A pass with K proposals costs one target pass plus K draft steps, each c (the
draft/target cost ratio) of a target decode step, so the speedup over plain
decoding is about that divided by (1 + K c) (Leviathan et al. 2023). This
assumes the target verifies K+1 tokens as fast as it decodes one (memory-bound).
"""

from __future__ import annotations

from dataclasses import dataclass, field


def expected_tokens_per_pass(alpha: float, k: int) -> float:
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, k: int, cost_ratio: float) -> float:
    return expected_tokens_per_pass(alpha, k) / (1.0 + k * cost_ratio)


def best_k(alpha: float, max_k: int, cost_ratio: float) -> int:
    """The K in [0, max_k] with the highest expected speedup (the smallest on ties)."""
    return max(range(max_k + 1), key=lambda k: (expected_speedup(alpha, k, cost_ratio), -k))


@dataclass(slots=True)
class _RequestStats:
    accepted: float
    judged: float
    steps_at_zero: int = 0


@dataclass(slots=True)
class AdaptiveK:
    """Per-request K from a moving estimate of its α.

    cost_ratio: what one more proposed token costs, as a fraction of a target
        decode step (the draft step plus verifying one more position).

    A request at K=0 learns nothing more, so every `probe_interval` steps it
    proposes one token again: text that turns predictable (a quote, a code
    block) gets speculation back.
    """

    max_k: int
    cost_ratio: float
    prior_alpha: float = 0.7
    decay: float = 0.8  # weight of the past per pass: about the last five passes count
    probe_interval: int = 16
    _stats: dict[str, _RequestStats] = field(default_factory=dict)

    def alpha(self, request_id: str) -> float:
        s = self._stats.get(request_id)
        return self.prior_alpha if s is None else s.accepted / s.judged

    def k_for(self, request_id: str) -> int:
        k = best_k(self.alpha(request_id), self.max_k, self.cost_ratio)
        if k > 0:
            return k
        s = self._stats.setdefault(request_id, _RequestStats(self.prior_alpha, 1.0))
        s.steps_at_zero += 1
        if s.steps_at_zero >= self.probe_interval:
            s.steps_at_zero = 0
            return 1
        return 0

    def update(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        s = self._stats.setdefault(request_id, _RequestStats(self.prior_alpha, 1.0))
        judged = num_accepted + (num_accepted < num_proposed)
        s.accepted = self.decay * s.accepted + num_accepted
        s.judged = self.decay * s.judged + judged

    def forget(self, request_id: str) -> None:
        self._stats.pop(request_id, None)
