"""Prompt lookup decoding: no model, just copying.

When the last n tokens already appeared earlier in the context, what followed
them there is a good guess for what follows now: summaries quote their source,
code edits repeat the code. Proposals are deterministic (a one-hot draft).
"""

from __future__ import annotations

import torch

from pdserve.engine.sequence import Sequence
from pdserve.engine.speculative.drafter import HostDrafter
from pdserve.engine.speculator import Proposals


class NgramDrafter(HostDrafter):
    def __init__(self, min_n: int, max_n: int, device: torch.device) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram drafter needs 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self.device = device

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposals:
        ids = [lookup(seq.token_ids, self.min_n, self.max_n, k) if k else [] for seq, k in zip(seqs, num_tokens)]
        return Proposals.from_lists(ids, self.device)

    def release(self, seq: Sequence) -> None:
        pass  # keeps nothing per sequence


def lookup(token_ids: list[int], min_n: int, max_n: int, num_tokens: int) -> list[int]:
    """Up to `num_tokens` tokens that followed the latest earlier occurrence of the
    context's last n tokens, trying the longest n first (a longer match is a
    surer guess); [] when nothing matches."""
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = token_ids[length - n:]
        first = suffix[0]
        # The latest occurrence first: it is the likeliest to be what is being copied.
        for start in range(length - n - 1, -1, -1):
            if token_ids[start] == first and token_ids[start:start + n] == suffix:
                return token_ids[start + n:start + n + num_tokens]
    return []
