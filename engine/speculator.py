"""The engine's hook for speculative decoding.

The engine proposes, schedules and verifies; what proposes the tokens (a
draft model, the target's first layers, n-gram lookup) and the acceptance rule
live above it, in `decode_node.spec`, and come in through this protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.sequence import Sequence


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
