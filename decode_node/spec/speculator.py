"""The engine's Speculator, made of a drafter, the acceptance rule and adaptive K."""

from __future__ import annotations

import torch

from pdserve.decode_node.spec.adaptive import AdaptiveK
from pdserve.decode_node.spec.drafter import Drafter
from pdserve.decode_node.spec.rejection import rejection_sample
from pdserve.engine.sequence import Sequence
from pdserve.engine.speculator import Proposal, SpecMetrics


class SpecDecoder:
    """Implements `engine.speculator.Speculator`.

    num_speculative_tokens: K for every request, or the most any request
        proposes when `adaptive` picks each request's K.
    """

    def __init__(self, drafter: Drafter, num_speculative_tokens: int, adaptive: AdaptiveK | None = None) -> None:
        self.drafter = drafter
        self.num_speculative_tokens = num_speculative_tokens
        self.adaptive = adaptive
        self.metrics = SpecMetrics()

    def propose(self, seqs: list[Sequence], max_num_tokens: list[int]) -> list[Proposal]:
        ks = [min(self._k(seq), limit) for seq, limit in zip(seqs, max_num_tokens)]
        chosen = [i for i, k in enumerate(ks) if k > 0]
        proposals = [Proposal([]) for _ in seqs]
        drafted = self.drafter.propose([seqs[i] for i in chosen], [ks[i] for i in chosen]) if chosen else []
        for i, proposal in zip(chosen, drafted):
            proposals[i] = proposal
        return proposals

    def verify(self, seq: Sequence, proposal: Proposal, target_probs: torch.Tensor,
               generator: torch.Generator) -> list[int]:
        token_ids = rejection_sample(proposal.token_ids, proposal.draft_probs, target_probs, generator)
        num_proposed, num_accepted = len(proposal.token_ids), len(token_ids) - 1
        self.metrics.record(num_proposed, num_accepted)
        if self.adaptive is not None:
            self.adaptive.update(seq.request_id, num_proposed, num_accepted)
        return token_ids

    def release(self, seq: Sequence) -> None:
        self.drafter.release(seq)
        if self.adaptive is not None:
            self.adaptive.forget(seq.request_id)

    def _k(self, seq: Sequence) -> int:
        return self.num_speculative_tokens if self.adaptive is None else self.adaptive.k_for(seq.request_id)
