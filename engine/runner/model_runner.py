"""Turns a scheduled batch into tensors, runs the model and samples."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping

import torch

from pdserve.engine.prompt_logprobs import PromptChunk, compute_chunk
from pdserve.engine.runner.cuda_graphs import StepGraphs
from pdserve.engine.runner.executor import Executor
from pdserve.engine.runner.mtp_carry import MTPCarry
from pdserve.engine.runner.step_inputs import InFlightTokens, StepInputBuilder
from pdserve.engine.runner.tensor_parallel import TensorParallelRanks
from pdserve.engine.sampler import PendingSample, Sampler, TokenLogprobs
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine.sequence import Sequence

# The logits to sample from, given the sequences and the model's rows for them (`sample_async`).
Prepare = Callable[[list[Sequence], torch.Tensor], torch.Tensor]


class StepLogits(Mapping[Sequence, torch.Tensor]):
    """A step's float32 logits: one tensor [rows, vocab] and each sequence's span of its rows
    (after its last token, then after each proposed token). `logits[seq]` is a view of the
    span; `rows_of` the first row of many spans as one tensor, a view when they are evenly
    spaced (every graph step: one row per sequence, or one every q rows), so a step hands
    its logits on without a tensor op per sequence. `prompt`: the step's share of the prompt
    log-probabilities that were asked for (`compute_logits`)."""

    __slots__ = ("values", "spans", "prompt")

    def __init__(self, values: torch.Tensor, spans: dict[Sequence, tuple[int, int]],
                 prompt: dict[Sequence, PromptChunk] | None = None) -> None:
        self.values = values
        self.spans = spans  # seq -> (first row, number of rows)
        self.prompt = prompt or {}

    def __getitem__(self, seq: Sequence) -> torch.Tensor:
        first, count = self.spans[seq]
        return self.values[first:first + count]

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self.spans)

    def __len__(self) -> int:
        return len(self.spans)

    def __contains__(self, seq: object) -> bool:
        return seq in self.spans

    def pop(self, seq: Sequence) -> torch.Tensor:
        rows = self[seq]
        del self.spans[seq]
        return rows

    def rows_of(self, seqs: list[Sequence]) -> torch.Tensor:
        """[len(seqs), vocab]: each sequence's first row, in order."""
        firsts = [self.spans[s][0] for s in seqs]
        values, first = self.values, firsts[0]
        step = firsts[1] - first if len(firsts) > 1 else 1
        if step > 0 and all(f == first + i * step for i, f in enumerate(firsts)):
            return values.as_strided((len(seqs), values.shape[1]), (step * values.stride(0), values.stride(1)),
                                     values.storage_offset() + first * values.stride(0))
        return torch.cat([values[f:f + 1] for f in firsts])


class ModelRunner:
    def __init__(self, executor: Executor, sampler: Sampler, inputs: StepInputBuilder,
                 graphs: StepGraphs | None = None, ranks: TensorParallelRanks | None = None) -> None:
        self.executor = executor  # runs each eager step (the graphs were captured through it)
        self.model = executor.model
        self.ranks = ranks  # the other tensor-parallel ranks: each eager step is sent to them first
        self.inputs = inputs  # the one builder of step inputs (shared with the graphs)
        self.graphs = graphs  # uniform steps (decodes, verifications) replay these (CUDA)
        self.sampler = sampler
        self.device = executor.device
        self.num_eager_steps = 0  # forwards that no graph served
        # A model built with its MTP layer: that layer's KV follows every step (mtp_carry.py).
        self.mtp = MTPCarry(self.model, executor.pool) if self.model.mtp is not None else None
        assert self.mtp is None or (graphs is None and ranks is None), "MTP steps run eagerly on one rank"

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> dict[Sequence, tuple[int, TokenLogprobs | None]]:
        """Compute the batch; returns {seq: (token_id, logprobs)} for each sequence
        whose scheduled tokens reach its end (mid-prompt chunks sample nothing).
        The batch must hold no proposed tokens (see `compute_logits`)."""
        return self.sample(self.compute_logits(batch))

    @torch.inference_mode()
    def compute_logits(self, batch: ScheduledBatch, in_flight: InFlightTokens | None = None,
                       prompt_logprobs: Collection[Sequence] = ()) -> StepLogits:
        """Run the model over the batch; for each sequence whose scheduled tokens
        reach the end of its tokens and of its proposals (`seq.spec_token_ids`),
        float32 logits [1 + num_proposed, vocab]: after its last token, then
        after each proposed token (what speculative verification needs).
        in_flight: the tokens of the step before, if it has not resolved yet.
        prompt_logprobs: sequences that want their prompt's log-probabilities: those of the
        prompt tokens this step's chunk predicts come back in `StepLogits.prompt` (such a step
        runs eagerly: the graphs keep one row per sequence)."""
        if not batch.seqs:
            return StepLogits(torch.empty(0), {})
        order = _decodes_first(batch)
        seqs, counts = [batch.seqs[i] for i in order], [batch.num_new_tokens[i] for i in order]
        wanted = _prompt_rows(seqs, counts, prompt_logprobs) if prompt_logprobs else []
        key = self.graphs.key_for(batch) if self.graphs is not None and not wanted else None
        if key is not None:
            assert self.graphs is not None
            inputs = self.inputs.build(batch.seqs, batch.num_new_tokens, in_flight, graph=(key[0], key[2]))
            logits = self.graphs.replay(key)
            return StepLogits(logits, {seq: (first, count) for seq, first, count in inputs.spans})
        self.num_eager_steps += 1
        inputs = self.inputs.build(seqs, counts, in_flight)
        if self.ranks is not None:
            self.ranks.run_step(inputs)
        hidden = self.executor.hidden(inputs)  # writes the KV, sampled or not
        if self.mtp is not None:
            self.mtp.write_step(seqs, counts, inputs, hidden)
        prompt = {seq: compute_chunk(self.model.compute_logits, hidden[row:row + len(ids)], first, ids,
                                     seq.params.prompt_logprobs or 0, self.model.arch.vocab_size)
                  for seq, row, first, ids in wanted}
        logits = self.executor.logits(hidden, inputs)
        if logits is None:  # mid-prompt chunks only
            return StepLogits(torch.empty(0), {}, prompt)
        return StepLogits(logits, {seq: (first, count) for seq, first, count in inputs.spans}, prompt)

    def sample(self, logits: StepLogits) -> dict[Sequence, tuple[int, TokenLogprobs | None]]:
        """Sample one token for each sequence from its one row of logits [1, vocab]."""
        seqs, pending = self.sample_async(logits)
        if pending is None:
            return {}
        out = pending.resolve()
        return {seq: (tok, lp) for seq, tok, lp in zip(seqs, out.token_ids, out.logprobs)}

    def sample_async(self, logits: StepLogits, prepare: Prepare | None = None
                     ) -> tuple[list[Sequence], PendingSample | None]:
        """`sample` without waiting for the GPU: the sequences, and their tokens in that order.
        prepare(seqs, rows): what to sample from, given the model's rows [len(seqs), vocab]
        (which the returned log-probabilities are of)."""
        if not logits:
            return [], None
        seqs = list(logits)
        assert all(logits.spans[s][1] == 1 for s in seqs), "sequences with proposed tokens are verified, not sampled"
        rows = logits.rows_of(seqs)
        return seqs, self.sampler.sample_async(rows if prepare is None else prepare(seqs, rows),
                                               [s.params for s in seqs], [s.next_output_index for s in seqs], rows)


def _decodes_first(batch: ScheduledBatch) -> list[int]:
    """Batch order with one-token decodes first, as the attention metadata expects."""
    is_decode = [n == 1 and s.num_computed_tokens > 0 for s, n in zip(batch.seqs, batch.num_new_tokens)]
    return sorted(range(len(batch)), key=lambda i: not is_decode[i])


def _prompt_rows(seqs: list[Sequence], counts: list[int], wanted: Collection[Sequence]
                 ) -> list[tuple[Sequence, int, int, list[int]]]:
    """For each wanted sequence whose chunk predicts prompt tokens: (seq, its first hidden row
    in the step, the first prompt entry predicted, the prompt tokens predicted). The row of
    position p predicts token p + 1; the last prompt position predicts the first output."""
    out, row = [], 0
    for seq, count in zip(seqs, counts):
        start = seq.num_computed_tokens
        end = min(start + count, seq.num_prompt_tokens - 1)
        if end > start and seq in wanted:
            out.append((seq, row, start + 1, list(seq.prompt_token_ids[start + 1:end + 1])))
        row += count
    return out
