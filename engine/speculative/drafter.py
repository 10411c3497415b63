"""What every drafter offers: proposals for a batch of decoding sequences."""

from __future__ import annotations

from typing import Protocol

import torch

from pdserve.engine.sequence import Sequence
from pdserve.engine.speculator import Proposals


class Drafter(Protocol):
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposals:
        """Up to `num_tokens[i]` tokens to follow `seqs[i]`'s last token (0: none for it).

        Greedy requests get deterministic proposals (one-hot or zero `draft_probs` rows);
        for sampled ones a drafter may sample and return the distributions it drew from.
        """
        ...

    def catch_up(self, seqs: list[Sequence], token_ids: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """A verification's outcome, still on the device, before the host reads it: the
        drafter may start on the next proposal there. `seqs` still hold the proposals they
        verified; token_ids [m, k + 1]: row i emits its first num_accepted[i] + 1."""
        ...

    def settle(self, seqs: list[Sequence], token_ids: list[list[int]]) -> None:
        """The same outcome as read by the host: the tokens each of `seqs` emits."""
        ...

    def release(self, seq: Sequence) -> None:
        """Free what the drafter keeps for `seq` (finished, aborted or preempted)."""
        ...


class HostDrafter:
    """A drafter that proposes from the tokens on the host: it has nothing to do between a
    verification and the next proposal (`Drafter.catch_up` and `settle`)."""

    def catch_up(self, seqs: list[Sequence], token_ids: torch.Tensor, num_accepted: torch.Tensor) -> None:
        pass

    def settle(self, seqs: list[Sequence], token_ids: list[list[int]]) -> None:
        pass
