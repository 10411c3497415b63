"""Turns a scheduled batch into tensors, runs the model and samples."""

from __future__ import annotations

import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.cuda_graphs import DecodeGraphs
from engine.kv_pool import KVPool
from engine.models.llama import LlamaForCausalLM
from engine.sampler import Sampler, SamplerOutput, TokenLogprobs
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, pool: KVPool, backend: AttentionBackend, sampler: Sampler,
                 graphs: DecodeGraphs | None = None) -> None:
        self.model = model
        self.graphs = graphs  # decode-only steps replay these (CUDA)
        self.pool = pool
        self.backend = backend
        self.sampler = sampler
        self.device = pool.kv.device
        self.block_size = pool.layout.block_size
        self.scale = model.arch.head_dim ** -0.5

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> dict[Sequence, tuple[int, TokenLogprobs | None]]:
        """Compute the batch; returns {seq: (token_id, logprobs)} for each sequence
        whose scheduled tokens reach its end (mid-prompt chunks sample nothing).
        The batch must hold no proposed tokens (see `compute_logits`)."""
        return self.sample(self.compute_logits(batch))

    @torch.inference_mode()
    def compute_logits(self, batch: ScheduledBatch) -> dict[Sequence, torch.Tensor]:
        """Run the model over the batch; for each sequence whose scheduled tokens
        reach the end of its tokens and of its proposals (`seq.spec_token_ids`),
        float32 logits [1 + num_proposed, vocab]: after its last token, then
        after each proposed token (what speculative verification needs)."""
        if self.graphs is not None and _is_plain_decode(batch, self.graphs.max_batch):
            logits = self.graphs.run(batch.seqs)
            return {seq: logits[i:i + 1] for i, seq in enumerate(batch.seqs)}
        order = _decodes_first(batch)
        seqs = [batch.seqs[i] for i in order]
        num_new = [batch.num_new_tokens[i] for i in order]
        input_ids, positions, meta, sample_rows = self._prepare(seqs, num_new)
        step = self.backend.begin_step(meta, self.pool, self.scale)
        hidden = self.model(input_ids, positions, step)
        rows = [row for first, count, _ in sample_rows for row in range(first, first + count)]
        if not rows:
            return {}
        logits = self.model.compute_logits(hidden[rows])
        out: dict[Sequence, torch.Tensor] = {}
        start = 0
        for _, count, seq in sample_rows:
            out[seq] = logits[start:start + count]
            start += count
        return out

    def sample(self, logits: dict[Sequence, torch.Tensor]) -> dict[Sequence, tuple[int, TokenLogprobs | None]]:
        """Sample one token for each sequence from its one row of logits [1, vocab]."""
        if not logits:
            return {}
        seqs = list(logits)
        rows = [logits[s] for s in seqs]
        assert all(r.shape[0] == 1 for r in rows), "sequences with proposed tokens are verified, not sampled"
        out: SamplerOutput = self.sampler.sample(
            torch.cat(rows), [s.request_id for s in seqs], [s.params for s in seqs])
        return {seq: (tok, lp) for seq, tok, lp in zip(seqs, out.token_ids, out.logprobs)}

    def _prepare(self, seqs: list[Sequence], num_new: list[int]
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[tuple[int, int, Sequence]]]:
        """Tensors and metadata for the step, and (first row, number of rows, seq)
        for the rows whose logits are wanted."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[tuple[int, int, Sequence]] = []
        decode_tables, decode_lens, prefill_tables, prefill_q_lens, prefill_lens = [], [], [], [], []
        for seq, n in zip(seqs, num_new):
            start = seq.num_computed_tokens
            end = start + n
            num_proposed = max(0, end - seq.num_tokens)  # the scheduler keeps only what fits
            input_ids.extend(seq.token_ids[start:end])
            input_ids.extend(seq.spec_token_ids[:num_proposed])
            positions.extend(range(start, end))
            blocks = seq.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            if end >= seq.num_tokens:
                sample_rows.append((len(input_ids) - 1 - num_proposed, 1 + num_proposed, seq))
            if n == 1 and start > 0:
                decode_tables.append(blocks)
                decode_lens.append(end)
            else:
                prefill_tables.append(blocks)
                prefill_q_lens.append(n)
                prefill_lens.append(end)
        dev = self.device
        cu = [0]
        for n in prefill_q_lens:
            cu.append(cu[-1] + n)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decodes=len(decode_lens),
            decode_block_tables=_block_table_tensor(decode_tables, dev),
            decode_seq_lens=torch.tensor(decode_lens, dtype=torch.int32, device=dev),
            prefill_cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            prefill_seq_lens=torch.tensor(prefill_lens, dtype=torch.int32, device=dev),
            prefill_block_tables=_block_table_tensor(prefill_tables, dev),
            prefill_max_seqlen_q=max(prefill_q_lens, default=0),
            decode_seq_lens_host=decode_lens,
            prefill_q_lens_host=prefill_q_lens,
            prefill_seq_lens_host=prefill_lens,
        )
        return (torch.tensor(input_ids, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev), meta, sample_rows)


def _is_plain_decode(batch: ScheduledBatch, max_batch: int) -> bool:
    """One new token per sequence, each its last, nothing proposed: what the graphs capture."""
    return 0 < len(batch) <= max_batch and all(
        n == 1 and s.num_computed_tokens == s.num_tokens - 1 and not s.spec_token_ids
        for s, n in zip(batch.seqs, batch.num_new_tokens))


def _decodes_first(batch: ScheduledBatch) -> list[int]:
    """Batch order with one-token decodes first, as the attention metadata expects."""
    is_decode = [n == 1 and s.num_computed_tokens > 0 for s, n in zip(batch.seqs, batch.num_new_tokens)]
    return sorted(range(len(batch)), key=lambda i: not is_decode[i])


def _block_table_tensor(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max((len(t) for t in tables), default=0)
    padded = [t + [0] * (width - len(t)) for t in tables]
    return torch.tensor(padded, dtype=torch.int32, device=device).reshape(len(tables), width)
