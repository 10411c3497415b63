"""What every drafter offers: proposals for a batch of decoding sequences."""

from __future__ import annotations

from typing import Protocol

from pdserve.engine.sequence import Sequence
from pdserve.engine.speculator import Proposals


class Drafter(Protocol):
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposals:
        """Up to `num_tokens[i]` tokens to follow `seqs[i]`'s last token (0: none for it).

        Greedy requests get deterministic proposals (one-hot or zero `draft_probs` rows);
        for sampled ones a drafter may sample and return the distributions it drew from.
        """
        ...

    def release(self, seq: Sequence) -> None:
        """Free what the drafter keeps for `seq` (finished, aborted or preempted)."""
        ...
