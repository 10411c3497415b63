"""Speculation counters, summed over every verification pass of a worker."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SpecMetrics:
    """num_passes: target passes that verified at least one proposed token.
    num_proposed / num_accepted: proposed tokens, and those the target kept.
    num_rejections: passes that stopped at a rejected token (the others accepted all).
    """

    num_passes: int = 0
    num_proposed: int = 0
    num_accepted: int = 0
    num_rejections: int = 0

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_passes += 1
        self.num_proposed += num_proposed
        self.num_accepted += num_accepted
        self.num_rejections += num_accepted < num_proposed

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed: the share of draft work that was kept."""
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0

    @property
    def alpha(self) -> float:
        """The formula's α: the chance a token is accepted given the ones before it
        were. Tokens after a rejection are never judged, so it is accepted /
        (accepted + rejections), not accepted / proposed."""
        judged = self.num_accepted + self.num_rejections
        return self.num_accepted / judged if judged else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Proposed tokens accepted per pass (each pass also emits one target token)."""
        return self.num_accepted / self.num_passes if self.num_passes else 0.0

    @property
    def mean_tokens_per_pass(self) -> float:
        return 1.0 + self.mean_accepted_length
