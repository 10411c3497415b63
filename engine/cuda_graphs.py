"""CUDA graphs for decode-only steps, one per batch-size bucket.

A decode step of a large model is hundreds of small kernel launches; replaying
a captured graph removes Python and launch overhead from the critical path.
Inputs live in static buffers; a batch is padded up to its bucket with rows
that write nothing (slot -1) and attend to nothing (context length 0).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.kv_pool import KVPool
from engine.models.llama import LlamaForCausalLM
from engine.sequence import Sequence

logger = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [bucket, vocab] float32, written by each replay


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, pool: KVPool, backend: AttentionBackend, scale: float,
                 max_batch: int, max_model_len: int) -> None:
        self.model = model
        self.pool = pool
        self.backend = backend
        self.scale = scale
        self.block_size = pool.layout.block_size
        self.buckets = [b for b in BUCKETS if b <= max_batch] or [1]
        if self.buckets[-1] < max_batch:
            self.buckets.append(max_batch)
        n, dev = self.buckets[-1], pool.kv.device
        self.max_blocks = -(-max_model_len // self.block_size)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self._graphs: dict[int, _Graph] = {}
        self._pool_handle = None

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def capture(self) -> None:
        """Capture every bucket, largest first so the smaller ones reuse its memory pool."""
        self._pool_handle = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.buckets):
            self._forward(bucket)  # warm up: Triton compiles outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool_handle):
                logits = self._forward(bucket)
            self._graphs[bucket] = _Graph(graph, logits)
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def run(self, seqs: list[Sequence]) -> torch.Tensor:
        """Decode one token for each of `seqs` (each has exactly one token without KV);
        returns float32 logits [len(seqs), vocab]. Valid until the next run."""
        n = len(seqs)
        bucket = next(b for b in self.buckets if b >= n)
        bs = self.block_size
        ids, pos, slots, lens = [], [], [], []
        table = torch.zeros(n, self.max_blocks, dtype=torch.int32)
        for i, seq in enumerate(seqs):
            p = seq.num_tokens - 1
            ids.append(seq.token_ids[p])
            pos.append(p)
            slots.append(seq.block_ids[p // bs] * bs + p % bs)
            lens.append(p + 1)
            table[i, :len(seq.block_ids)] = torch.tensor(seq.block_ids, dtype=torch.int32)
        pad = bucket - n
        self.input_ids[:bucket].copy_(torch.tensor(ids + [0] * pad), non_blocking=True)
        self.positions[:bucket].copy_(torch.tensor(pos + [0] * pad), non_blocking=True)
        self.slot_mapping[:bucket].copy_(torch.tensor(slots + [-1] * pad), non_blocking=True)
        self.seq_lens[:bucket].copy_(torch.tensor(lens + [0] * pad, dtype=torch.int32), non_blocking=True)
        self.block_tables[:n].copy_(table, non_blocking=True)
        self.block_tables[n:bucket].zero_()
        g = self._graphs[bucket]
        g.graph.replay()
        return g.logits[:n]

    def _forward(self, bucket: int) -> torch.Tensor:
        dev = self.input_ids.device
        empty = torch.zeros(0, dtype=torch.int32, device=dev)
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            num_decodes=bucket,
            decode_block_tables=self.block_tables[:bucket],
            decode_seq_lens=self.seq_lens[:bucket],
            prefill_cu_seqlens_q=torch.zeros(1, dtype=torch.int32, device=dev),
            prefill_seq_lens=empty,
            prefill_block_tables=empty.reshape(0, 0),
            prefill_max_seqlen_q=0,
            decode_seq_lens_host=[],
            prefill_q_lens_host=[],
            prefill_seq_lens_host=[],
        )
        step = self.backend.begin_step(meta, self.pool, self.scale)
        hidden = self.model(self.input_ids[:bucket], self.positions[:bucket], step)
        return self.model.compute_logits(hidden)
