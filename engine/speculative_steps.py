"""Speculation inside the engine's step: how many tokens the step drafts (the speculator's
plan), the drafts placed in the decoding sequences for the step's pass to verify, and the
tokens each sequence emits once the pass's logits are in.

The engine's step core (step_core.py) drives it around one step: `plan` and `propose` before scheduling,
`verify` when the step resolves. What drafts and what accepts live behind the `Speculator`
protocol (engine/speculator.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.grammar import StructuredOutputs
from pdserve.engine.penalties import Penalties
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import PLACEHOLDER_TOKEN_ID, Sequence
from pdserve.engine.speculator import Proposals, Speculator

# The running sequences that decode this step, and how many tokens each may propose at most.
Decoding = tuple[list[Sequence], list[int]]


@dataclass(slots=True)
class StepProposals:
    """What the drafter proposed this step: the batch's proposals and each sequence's row."""

    proposals: Proposals
    rows: dict[Sequence, int]
    num_proposed: dict[Sequence, int]  # the real ones: `spec_token_ids` may be padded past them


class SpeculativeSteps:
    """One engine's speculation, step by step.

    `uniform`: every sequence of a step verifies as many tokens (CUDA graphs: one graph
    replays the step), a shorter proposal padded with tokens never accepted.
    """

    def __init__(self, speculator: Speculator, scheduler: Scheduler, structured: StructuredOutputs,
                 penalties: Penalties, uniform: bool) -> None:
        self.speculator = speculator
        self._scheduler = scheduler
        self._structured = structured
        self._penalties = penalties
        self._uniform = uniform

    def plan(self) -> tuple[int, Decoding]:
        """The step's K (0: a plain step) and who decodes now. Clears every running
        sequence's proposals of the step before."""
        decoding = self._decoding()
        seqs, limits = decoding
        return (self.speculator.plan(seqs) if any(limits) else 0), decoding

    def propose(self, k: int, decoding: Decoding | None = None) -> StepProposals | None:
        """Draft up to `k` tokens for each decoding sequence (`decoding` from `plan`, or
        taken afresh when None: a step resolved since); this step's pass verifies them."""
        seqs, limits = decoding if decoding is not None else self._decoding()
        limits = [min(k, limit) for limit in limits]
        if not any(limits):
            return None
        proposals = self.speculator.propose(seqs, limits)
        width = max(proposals.num_tokens, default=0)
        if width == 0:
            return None
        rows, num_proposed = {}, {}
        host = proposals.host_token_ids
        for i, (seq, n) in enumerate(zip(seqs, proposals.num_tokens)):
            # A uniform step pads a shorter proposal (one near max_tokens too) with tokens
            # never accepted (their KV is trimmed as a rejected guess's is; eagerly, on the
            # CPU, they would cost compute). Drafted on the device: placeholders here, read
            # there (zeros past a proposal).
            num = min(width, self._scheduler.max_model_len - seq.num_tokens) if self._uniform else n
            self._scheduler.propose(seq, host[i][:n] + [0] * (num - n) if host is not None
                                    else [PLACEHOLDER_TOKEN_ID] * num)
            if num:
                rows[seq], num_proposed[seq] = i, n
        return StepProposals(proposals, rows, num_proposed) if rows else None

    def verify(self, verifying: dict[Sequence, torch.Tensor], step: StepProposals | None) -> dict[Sequence, list[int]]:
        """The tokens each sequence that verified in the step emits (one read of the device).
        verifying: each one's logits [1 + K, vocab] from the step's pass."""
        if not verifying:
            return {}
        assert step is not None
        seqs = [seq for seq in verifying if not seq.is_finished]
        if not seqs:
            return {}
        # The scheduler may have kept fewer than proposed (the token budget).
        num_proposed = [min(step.num_proposed[s], len(s.spec_token_ids)) for s in seqs]
        rows = [step.rows[s] for s in seqs]
        # Penalties and bias at each position (the proposals before it counted), on a copy: the
        # accepted tokens' log-probabilities are the model's. The grammars' masks come last.
        logits = [verifying[s] for s in seqs]
        judged = self._penalties.adjusted_proposals(seqs, logits, step.proposals.token_ids, rows)
        if self._structured.has_active:
            self._mask_proposals(seqs, num_proposed, logits, judged, step)
        token_ids = self.speculator.verify(seqs, step.proposals, rows, num_proposed, judged)
        return dict(zip(seqs, token_ids))

    def release(self, seq: Sequence) -> None:
        self.speculator.release(seq)

    def _decoding(self) -> Decoding:
        """The running sequences that are decoding (the last token is the only one without
        KV) and how many tokens each may propose at most (0: it is at its last token). Clears
        every running sequence's proposals of the step before."""
        seqs, limits = [], []
        for seq in self._scheduler.running:
            self._scheduler.propose(seq, [])
            # The accepted tokens plus the target's own must fit max_tokens and the context.
            limit = seq.remaining_tokens(self._scheduler.max_model_len) - 1
            # In a uniform step a sequence at its last token verifies padding too: the batch stays uniform.
            if seq.num_computed_tokens == seq.num_tokens - 1 and (limit > 0 or self._uniform):
                seqs.append(seq)
                limits.append(max(limit, 0))
        return seqs, limits

    def _mask_proposals(self, seqs: list[Sequence], num_proposed: list[int], logits: list[torch.Tensor],
                        judged: list[torch.Tensor], step: StepProposals) -> None:
        """A constrained sequence's target logits (the model's, and the penalized copy the
        proposals are judged by when it has one) masked, row by row, by what its grammar allows
        after the proposals before it, so that a draft token outside the grammar is rejected
        (the proposals' ids come to the host for it: a read per constrained sequence)."""
        for seq, n, model, adjusted in zip(seqs, num_proposed, logits, judged):
            if seq.params.structured is None:
                continue
            ids = seq.spec_token_ids[:n]
            if ids and ids[0] == PLACEHOLDER_TOKEN_ID:
                ids = step.proposals.token_ids[step.rows[seq], :n].tolist()
            # In place: the rows are a view of the step's logits, which the acceptance reads.
            self._structured.mask_proposal(seq, model[:n + 1], ids, *(() if adjusted is model else (adjusted[:n + 1],)))
