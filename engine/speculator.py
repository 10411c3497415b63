"""The engine's hook for speculative decoding.

The engine proposes, schedules and verifies; what proposes the tokens (a
draft model, the target's first layers, n-gram lookup) and the acceptance rule
live above it, in `decode_node.spec`, and come in through this protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.engine.sequence import Sequence


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


@dataclass(slots=True)
class Proposal:
    """Draft tokens to follow a sequence's last token.

    draft_probs: [len(token_ids), vocab] float32, the distribution each token
        was drawn from; None when the tokens were picked deterministically (a
        one-hot distribution: greedy drafting, n-gram lookup).
    """

    token_ids: list[int]
    draft_probs: torch.Tensor | None = None

    def truncated(self, num_tokens: int) -> Proposal:
        probs = None if self.draft_probs is None else self.draft_probs[:num_tokens]
        return Proposal(self.token_ids[:num_tokens], probs)


class Speculator(Protocol):
    metrics: SpecMetrics

    def propose(self, seqs: list[Sequence], max_num_tokens: list[int]) -> list[Proposal]:
        """Draft tokens to follow each sequence's last token (whose KV the target
        has not computed yet): at most `max_num_tokens[i]` (>= 1) for `seqs[i]`.
        An empty proposal leaves that sequence to a plain decode step."""
        ...

    def verify(self, seq: Sequence, proposal: Proposal, target_probs: torch.Tensor,
               generator: torch.Generator) -> list[int]:
        """Accept a prefix of `proposal` so that the output keeps the target's
        distribution; returns the accepted tokens plus one drawn from the target
        (1 to K+1 tokens). Also rolls back draft state past the accepted tokens.

        target_probs: [K+1, vocab] float32, what the target samples from after the
            sequence's last token and after each proposed token.
        generator: the request's random stream.
        """
        ...

    def release(self, seq: Sequence) -> None:
        """Forget `seq` (finished, aborted or preempted): free its draft state."""
        ...
