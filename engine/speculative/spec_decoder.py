"""The engine's Speculator, made of a drafter, the acceptance rule and adaptive K."""

from __future__ import annotations

import torch

from pdserve.engine.sampler import HostCopy, Sampler, on_device
from pdserve.engine.sequence import Sequence
from pdserve.engine.speculative import rejection
from pdserve.engine.speculative.adaptive import AdaptiveK
from pdserve.engine.speculative.drafter import Drafter
from pdserve.engine.speculator import Proposals, SpecMetrics


class SpecDecoder:
    """Implements `engine.speculator.Speculator`.

    num_speculative_tokens: K for every step, or the most a step proposes when
        `adaptive` picks each step's K.
    """

    def __init__(self, drafter: Drafter, sampler: Sampler, num_speculative_tokens: int,
                 adaptive: AdaptiveK | None = None) -> None:
        self.drafter = drafter
        self.sampler = sampler
        self.num_speculative_tokens = num_speculative_tokens
        self.adaptive = adaptive
        self.metrics = SpecMetrics()

    def plan(self, seqs: list[Sequence]) -> int:
        k = self.adaptive.k_for(seqs) if self.adaptive is not None else self.num_speculative_tokens
        self.metrics.record_step(k)
        return k

    def propose(self, seqs: list[Sequence], max_num_tokens: list[int]) -> Proposals:
        return self.drafter.propose(seqs, max_num_tokens)

    def verify(self, seqs: list[Sequence], proposals: Proposals, rows: list[int], num_proposed: list[int],
               logits: list[torch.Tensor]) -> list[list[int]]:
        device = proposals.token_ids.device
        # Every row verified as many positions (padded proposals), whatever it really proposed.
        k = max(x.shape[0] for x in logits) - 1
        m = len(seqs)
        target = _stacked(logits, k + 1)  # [m, k + 1, vocab]
        index = on_device(rows, torch.int64, device)
        draft_ids = _widened(proposals.token_ids.index_select(0, index), k)
        counts = on_device(num_proposed, torch.int64, device)
        params = [s.params for s in seqs]
        if all(p.greedy for p in params):
            num_accepted, token_ids = rejection.greedy_verify(draft_ids, counts, target.argmax(dim=2))
        else:
            vocab = target.shape[2]
            per_row = [p for p in params for _ in range(k + 1)]
            probs = self.sampler.filtered_probs(target.reshape(m * (k + 1), vocab), per_row).view(m, k + 1, vocab)
            if any(p.greedy for p in params):
                greedy = on_device([p.greedy for p in params], torch.bool, device)
                one_hot = torch.nn.functional.one_hot(target.argmax(dim=2), vocab).float()
                probs = torch.where(greedy[:, None, None], one_hot, probs)
            draft_probs = proposals.draft_probs
            if draft_probs is not None:
                draft_probs = _widened(draft_probs.index_select(0, index), k)
            uniforms, exponentials = self._noise(seqs, k, vocab)
            num_accepted, token_ids = rejection.rejection_sample(draft_ids, counts, draft_probs, probs,
                                                                 uniforms, exponentials)
        # The one read back of the step: every sequence's count and tokens together, queued
        # before the drafter's catch-up so that the host reads while the draft computes.
        host = HostCopy.of(torch.cat([num_accepted[:, None], token_ids], dim=1))
        self.drafter.catch_up(seqs, token_ids, num_accepted)
        out = []
        for seq, proposed, row in zip(seqs, num_proposed, host.get().tolist()):
            n = row[0]
            out.append(row[1:n + 2])
            if not proposed:  # a padded row: a plain decode
                continue
            self.metrics.record(proposed, n)
            if self.adaptive is not None:
                self.adaptive.update(seq.request_id, proposed, n)
        self.drafter.settle(seqs, out)
        return out

    def _noise(self, seqs: list[Sequence], k: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The acceptance rule's draws: uniforms [m, k], one per proposal, and exponentials
        for the emitted token, [m, vocab] or, with seeded rows, [m, k + 1, vocab]: one per
        position it may land on. A seeded row's draws at position i are those of output
        index `next_output_index + i`, the index the token there gets, so that they do not
        depend on how the request's tokens were split into steps."""
        m = len(seqs)
        params = [s.params for s in seqs]
        if not any(p.seed is not None and not p.greedy for p in params):  # the shared stream alone
            unkeyed = [0] * m
            return (self.sampler.noise((m, k), params, unkeyed, "uniform"),
                    self.sampler.noise((m, vocab), params, unkeyed, "exponential"))
        per_position = [p for p in params for _ in range(k + 1)]
        indices = [s.next_output_index + i for s in seqs for i in range(k + 1)]
        uniforms = self.sampler.noise((m * (k + 1), 1), per_position, indices, "uniform").view(m, k + 1)[:, :k]
        exponentials = self.sampler.noise((m * (k + 1), vocab), per_position, indices, "exponential")
        return uniforms, exponentials.view(m, k + 1, vocab)

    def release(self, seq: Sequence) -> None:
        self.drafter.release(seq)
        if self.adaptive is not None:
            self.adaptive.forget(seq.request_id)


def _stacked(logits: list[torch.Tensor], rows: int) -> torch.Tensor:
    """[m, rows, vocab] from m tensors of up to `rows` rows: a view when they are
    consecutive blocks of one tensor (a graph's or an eager step's uniform batch), else a
    copy padded with zeros (rows past a sequence's proposals are never accepted)."""
    first = logits[0]
    stride = first.stride(0) * first.element_size()
    if all(x.shape[0] == rows and x.data_ptr() == first.data_ptr() + i * rows * stride for i, x in enumerate(logits)):
        return first.as_strided((len(logits), rows, first.shape[1]), (rows * first.stride(0), first.stride(0), 1))
    out = first.new_zeros((len(logits), rows, first.shape[1]))
    for i, x in enumerate(logits):
        out[i, :x.shape[0]] = x
    return out


def _widened(x: torch.Tensor, width: int) -> torch.Tensor:
    """x [m, w, ...] cut or zero-padded to [m, width, ...] along its second dim."""
    if x.shape[1] >= width:
        return x[:, :width]
    pad = x.new_zeros((x.shape[0], width - x.shape[1], *x.shape[2:]))
    return torch.cat([x, pad], dim=1)
