"""Prompt log-probabilities: each prompt token's log-probability under the tokens before it,
its rank and the top alternatives (vLLM's `prompt_logprobs`, OpenAI's `echo` with logprobs),
from the prefill's own forward: no second pass.

The step that computes a chunk of such a prompt keeps the final hidden states of the chunk's
positions (`ModelRunner.compute_logits`); here they become logits a piece at a time, so that
a 2,048-token chunk never holds [2048, vocab] float32 at once (400 MB at a 49k vocabulary),
and only [rows, 2 + 2 * top] numbers per piece survive it. The engine collects each
request's chunks (`PromptLogprobs`, in order, a recomputed chunk after a preemption
skipped) and hands the whole list out with the request's first token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pdserve.engine.sampler import HostCopy, TokenLogprobs

# Rows of logits materialized at once: a piece's logits and log-softmax stay near this many bytes.
_PIECE_BYTES = 64 << 20


@dataclass(slots=True)
class PromptChunk:
    """One step's share of a prompt's log-probabilities, on its way from the device: the
    entries of prompt positions `first` .. `first + len(token_ids) - 1` (entry i: token i
    under tokens 0..i-1)."""

    first: int
    token_ids: list[int]
    num_top: int
    _values: HostCopy  # [n, 2 + 2 * num_top] float32: logprob, rank, top ids, top logprobs

    def resolve(self) -> list[TokenLogprobs]:
        rows = self._values.get().tolist()
        k = self.num_top
        return [TokenLogprobs(t, r[0], tuple(int(i) for i in r[2:2 + k]), tuple(r[2 + k:]), int(r[1]))
                for t, r in zip(self.token_ids, rows)]


def compute_chunk(logits_of: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, first: int,
                  token_ids: list[int], num_top: int, vocab_size: int) -> PromptChunk:
    """Queue the log-probabilities of `token_ids` (prompt entries `first`..) on the device.

    logits_of: final hidden states [n, hidden] -> float32 logits [n, vocab] (the model's LM head).
    hidden: [len(token_ids), hidden], row j the hidden state after prompt token first - 1 + j.
    num_top: alternatives per entry (0..MAX_LOGPROBS).
    """
    n = len(token_ids)
    ids = torch.tensor(token_ids, dtype=torch.int64).to(hidden.device, non_blocking=True)
    out = torch.empty((n, 2 + 2 * num_top), dtype=torch.float32, device=hidden.device)
    piece = max(1, _PIECE_BYTES // (4 * vocab_size))
    for start in range(0, n, piece):
        end = min(n, start + piece)
        logp = torch.log_softmax(logits_of(hidden[start:end]), dim=-1)
        chosen = logp.gather(1, ids[start:end, None])
        out[start:end, 0] = chosen[:, 0]
        out[start:end, 1] = (logp > chosen).sum(dim=-1) + 1  # exact in float32 below 2**24
        if num_top:
            top_vals, top_ids = logp.topk(num_top, dim=-1)
            out[start:end, 2:2 + num_top] = top_ids
            out[start:end, 2 + num_top:] = top_vals
    return PromptChunk(first, token_ids, num_top, HostCopy.of(out))


@dataclass(slots=True)
class PromptLogprobs:
    """A request's prompt log-probabilities as its chunks resolve: entry 0 (the first token,
    which nothing predicts) is None."""

    num_prompt_tokens: int
    entries: list[TokenLogprobs | None] = field(default_factory=lambda: [None])

    @property
    def complete(self) -> bool:
        return len(self.entries) == self.num_prompt_tokens

    def add(self, chunk: PromptChunk) -> None:
        """A resolved chunk's entries; those already here (a chunk computed again after a
        preemption) are skipped."""
        have = len(self.entries)
        assert chunk.first <= have, "a prompt's chunks resolve in order"
        skip = have - chunk.first
        if skip < len(chunk.token_ids):
            self.entries.extend(chunk.resolve()[skip:])
