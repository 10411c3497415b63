"""The engine's hook for speculative decoding.

The engine proposes, schedules and verifies; what proposes the tokens (a
draft model, the target's first layers, n-gram lookup) and the acceptance rule
live in `engine.speculative`, which the engine core does not import: they come in through
this protocol.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pdserve.engine.sequence import Sequence


@dataclass(slots=True)
class SpecMetrics:
    """num_passes: target passes that verified at least one proposed token.
    num_proposed / num_accepted: proposed tokens, and those the target kept.
    num_rejections: passes that stopped at a rejected token (the others accepted all).
    num_steps_by_k: steps by the K they proposed (0: adaptive K turned speculation off).
    """

    num_passes: int = 0
    num_proposed: int = 0
    num_accepted: int = 0
    num_rejections: int = 0
    num_steps_by_k: dict[int, int] = field(default_factory=dict)

    def record_step(self, k: int) -> None:
        self.num_steps_by_k[k] = self.num_steps_by_k.get(k, 0) + 1

    def snapshot(self) -> SpecMetrics:
        return dataclasses.replace(self, num_steps_by_k=dict(self.num_steps_by_k))

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
class Proposals:
    """Draft tokens for a batch of sequences: `seqs[i]` proposes `token_ids[i, :num_tokens[i]]`
    to follow its last token.

    token_ids: [n, width] int64 on the engine's device, where the verification step reads
        them (a model drafter never brings them to the host).
    draft_probs: [n, width, vocab] float32, the distribution each token was drawn from;
        None when every token was picked deterministically (a one-hot distribution: greedy
        drafting, n-gram lookup). Rows of greedy requests may be zeros (treated as one-hot).
    host_token_ids: the same ids on the host, when the drafter made them there (n-gram lookup).
    """

    token_ids: torch.Tensor
    num_tokens: list[int]
    draft_probs: torch.Tensor | None = None
    host_token_ids: list[list[int]] | None = None

    @staticmethod
    def from_lists(token_ids: list[list[int]], device: torch.device,
                   draft_probs: list[torch.Tensor | None] | None = None) -> Proposals:
        """Proposals made on the host; draft_probs[i]: [len(token_ids[i]), vocab] or None (one-hot)."""
        width = max((len(ids) for ids in token_ids), default=0)
        host = torch.zeros((len(token_ids), width), dtype=torch.int64)
        for i, ids in enumerate(token_ids):
            host[i, :len(ids)] = torch.tensor(ids, dtype=torch.int64)
        probs = None
        if draft_probs is not None and any(p is not None for p in draft_probs):
            vocab = next(p for p in draft_probs if p is not None).shape[-1]
            probs = torch.zeros((len(token_ids), width, vocab), dtype=torch.float32, device=device)
            for i, p in enumerate(draft_probs):
                if p is not None:
                    probs[i, :p.shape[0]] = p
        on_gpu = device.type == "cuda"
        ids = (host.pin_memory().to(device, non_blocking=True) if on_gpu else host)
        return Proposals(ids, [len(t) for t in token_ids], probs, [list(t) for t in token_ids])


class Speculator(Protocol):
    metrics: SpecMetrics

    def plan(self, seqs: list[Sequence]) -> int:
        """This step's K for the decoding `seqs`: how many tokens each may propose; 0 makes
        it a plain step (which may overlap the step before it). Called once per step."""
        ...

    def propose(self, seqs: list[Sequence], max_num_tokens: list[int]) -> Proposals:
        """Draft tokens to follow each sequence's last token (whose KV the target
        has not computed yet): at most `max_num_tokens[i]` for `seqs[i]` (0: none, it
        is at its last token; never more than `plan`'s K). A sequence that proposes none
        gets a plain decode's token."""
        ...

    def verify(self, seqs: list[Sequence], proposals: Proposals, rows: list[int], num_proposed: list[int],
               logits: list[torch.Tensor]) -> list[list[int]]:
        """Accept a prefix of each sequence's proposal so that the output keeps the target's
        distribution: for `seqs[i]`, the first `num_proposed[i]` tokens of row `rows[i]` of
        `proposals`, judged against `logits[i]` ([num_proposed[i] + 1, vocab] float32: what
        the target saw after the sequence's last token and after each proposed token).
        Returns each sequence's accepted tokens plus one drawn from the target (1 to K+1
        tokens), reading the device once for the whole batch."""
        ...

    def release(self, seq: Sequence) -> None:
        """Forget `seq` (finished, aborted or preempted): free its draft state."""
        ...
