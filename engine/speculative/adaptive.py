"""How many tokens to propose: the expected-speedup model, and adaptive K per step.

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

import math
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.engine.runner.cuda_graphs import StepGraphs
from pdserve.engine.sequence import Sequence


def expected_tokens_per_pass(alpha: float, k: int) -> float:
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, k: int, cost_ratio: float) -> float:
    return expected_tokens_per_pass(alpha, k) / (1.0 + k * cost_ratio)


def best_k(alpha: float, max_k: int, cost_ratio: float) -> int:
    """The K in [0, max_k] with the highest expected speedup (the smallest on ties)."""
    return max(range(max_k + 1), key=lambda k: (expected_speedup(alpha, k, cost_ratio), -k))


class PassCosts(Protocol):
    def step_ms(self, batch_size: int, k: int) -> float:
        """Time of one step of `batch_size` sequences proposing k tokens each (k = 0: a
        plain decode step): the target's pass over k + 1 tokens plus k draft steps. Any
        unit, the same for every k; inf where such a step has no fast path."""
        ...


@dataclass(frozen=True, slots=True)
class RelativeCosts:
    """Costs as fractions of a decode step, where nothing was timed (the CPU, no graphs):
    each proposed token adds `cost_ratio` (its draft step plus one more verified position)."""

    cost_ratio: float

    def step_ms(self, batch_size: int, k: int) -> float:
        return 1.0 + k * self.cost_ratio


@dataclass(frozen=True, slots=True)
class MeasuredCosts:
    """Costs from the replay times of captured CUDA graphs, per bucket and tokens per sequence
    (`StepGraphs.replay_ms`): the target's, and the draft model's (None: a drafter that costs
    nothing on the device, n-gram lookup). The draft's first step re-reads two tokens (see
    `ModelDrafter`), the rest one."""

    target: StepGraphs
    draft: StepGraphs | None = None

    def step_ms(self, batch_size: int, k: int) -> float:
        total = _replay_ms(self.target, batch_size, k + 1)
        if k and self.draft is not None:
            total += _replay_ms(self.draft, batch_size, 2) + (k - 1) * _replay_ms(self.draft, batch_size, 1)
        return total


def _replay_ms(graphs: StepGraphs, batch_size: int, q: int) -> float:
    bucket = graphs.bucket_for(batch_size, q)
    return math.inf if bucket is None else graphs.replay_ms.get((bucket, q), math.inf)


@dataclass(slots=True)
class _RequestStats:
    accepted: float
    judged: float


@dataclass(slots=True)
class AdaptiveK:
    """One K per step, from a moving estimate of each request's α and what a step costs at
    this batch size: the K with the most expected tokens per unit of time,
    sum_i (1 - α_i^(K+1)) / (1 - α_i) / step_ms(batch, K), K = 0 (no speculation) included.

    A request's α is its recent acceptance shrunk toward the engine's: the engine-wide
    estimate counts as `prior_weight` judged tokens in every request's, so one unlucky pass
    at a request's start does not switch speculation off (with only the request's own few
    tokens, a first token rejected read as α ≈ 0.3, and K = 0 then learns nothing until the
    next probe), and a new request starts from what this workload accepts, not from a
    constant. `prior_alpha` is the engine's estimate before anything was judged, worth
    `prior_weight` judged tokens, and fades as the engine judges its own.

    A step at K = 0 learns nothing more, so after `probe_interval` steps at K = 0 one step
    proposes one token again: text that turns predictable (a quote, a code block) gets
    speculation back. A probe is not free (the draft model catches up on every token it
    skipped), so each probe that does not turn speculation back on doubles the interval,
    up to `max_probe_interval`.
    """

    max_k: int
    costs: PassCosts
    prior_alpha: float = 0.7
    prior_weight: float = 8.0
    decay: float = 0.8  # weight of a request's past per pass: about its last five passes count
    overall_decay: float = 0.98  # the same for the engine-wide estimate, per request's pass
    probe_interval: int = 16
    max_probe_interval: int = 256
    _stats: dict[str, _RequestStats] = field(default_factory=dict)
    _overall: _RequestStats = field(init=False)  # starts as the prior, which fades as passes are judged
    _steps_at_zero: int = 0
    _interval: int = 0  # the current probe interval (0: probe_interval)

    def __post_init__(self) -> None:
        self._overall = _RequestStats(self.prior_weight * self.prior_alpha, self.prior_weight)

    def overall_alpha(self) -> float:
        return self._overall.accepted / self._overall.judged

    def alpha(self, request_id: str) -> float:
        s, w = self._stats.get(request_id), self.prior_weight
        prior = self.overall_alpha()
        return prior if s is None else (s.accepted + w * prior) / (s.judged + w)

    def k_for(self, seqs: list[Sequence]) -> int:
        alphas = [self.alpha(s.request_id) for s in seqs]
        n = len(seqs)

        def rate(k: int) -> float:
            return sum(expected_tokens_per_pass(a, k) for a in alphas) / self.costs.step_ms(n, k)

        k = max(range(self.max_k + 1), key=lambda k: (rate(k), -k))
        interval = self._interval or self.probe_interval
        if k > 0:
            if self._steps_at_zero < interval:  # chosen, not probed: speculation pays again
                self._interval = 0
            self._steps_at_zero = 0
            return k
        self._steps_at_zero += 1
        if self._steps_at_zero >= interval:
            self._steps_at_zero = 0
            self._interval = min(2 * interval, self.max_probe_interval)
            return 1
        return 0

    def update(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        judged = num_accepted + (num_accepted < num_proposed)
        for s, decay in ((self._stats.setdefault(request_id, _RequestStats(0.0, 0.0)), self.decay),
                         (self._overall, self.overall_decay)):
            s.accepted = decay * s.accepted + num_accepted
            s.judged = decay * s.judged + judged

    def forget(self, request_id: str) -> None:
        self._stats.pop(request_id, None)
