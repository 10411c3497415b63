"""CUDA graphs for uniform steps: every sequence advances by the same q tokens that reach
its end. q = 1 is a decode step; q = K + 1 a speculative verification (the last token and
K proposals); q = 2 a draft model's catch-up (its last two tokens, see `ModelDrafter`).
One graph per (batch-size bucket, q, context tier).

A decode step of a large model is hundreds of small kernel launches; replaying a captured
graph removes Python and launch overhead from the critical path. Inputs live in the
step-input builder's fixed buffers; a batch is padded up to its bucket with sequences that
write nothing (slot -1) and attend to nothing (context length 0).

A graph fixes its attention kernel's work split, which the launcher sizes for the
longest context the block table can hold. Small batches split long contexts across the
GPU (flash-decoding), so their graphs come in context tiers: the graph of the shortest
tier that holds the batch's longest sequence replays, with splits sized for that tier
rather than for max_model_len (at batch 1 and 1k context: 8 splits, not 66). A latent
(MLA) pool's steps split as `kernels.mla_decode` does (every head of a sequence reads its
one latent row), so its tiers follow that kernel's split count.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from pdserve.engine.runner.executor import Executor
from pdserve.engine.runner.step_inputs import StepInputBuilder
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.kernels.mla_decode import mla_decode_default_splits
from pdserve.kernels.paged_decode import decode_num_splits

logger = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TIER_TOKENS = (2048, 8192, 32768)  # context tiers below max_model_len

GraphKey = tuple[int, int, int]  # (bucket, tokens per sequence, block-table width)


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [bucket * q, vocab] float32, written by each replay


class StepGraphs:
    """Captures and replays uniform steps. Inputs come from `StepInputBuilder.build(...,
    graph=(bucket, width))`, which writes them into the views each graph was captured over.

    tokens_per_seq: the q values to capture (1: decodes).
    max_batch: the largest bucket of q = 1; `max_multi_batch` that of the other q values
        (speculation does not pay at large batches, so their graphs stop earlier).
    """

    def __init__(self, executor: Executor, inputs: StepInputBuilder, max_batch: int,
                 tokens_per_seq: tuple[int, ...] = (1,), max_multi_batch: int | None = None) -> None:
        self.executor = executor
        self.inputs = inputs
        self.tokens_per_seq = tuple(sorted(set(tokens_per_seq)))
        buckets = [b for b in BUCKETS if b <= max_batch] or [1]
        if buckets[-1] < max_batch:
            buckets.append(max_batch)
        # A bucket of q tokens per sequence needs bucket * q input rows.
        self.buckets = {q: [b for b in buckets if b * q <= inputs.max_tokens
                            and (q == 1 or b <= (max_multi_batch or max_batch))] for q in self.tokens_per_seq}
        block_size = executor.pool.layout.block_size
        widths = sorted({-(-t // block_size) for t in TIER_TOKENS if t < inputs.max_blocks * block_size}
                        | {inputs.max_blocks})
        # Per bucket, the tiers (block-table widths) whose attention splits differ: the
        # widest width of each split count.
        self.tiers: dict[int, list[int]] = {}
        for bucket in buckets:
            by_splits = {self._num_splits(bucket, w * block_size): w for w in widths}
            self.tiers[bucket] = sorted(by_splits.values())
        self._graphs: dict[GraphKey, _Graph] = {}
        self.replay_ms: dict[tuple[int, int], float] = {}  # (bucket, q) -> a replay's GPU time, widest tier
        self.num_replays: dict[int, int] = {}  # by q, the steps served (not the capture's timing replays)

    def _num_splits(self, batch: int, context: int) -> int:
        """The split count a decode step of `batch` sequences over a block table of `context`
        tokens launches its attention with."""
        executor = self.executor
        layout, device = executor.pool.layout, executor.device
        if layout.kind == "mla":
            return mla_decode_default_splits(batch, executor.model.tp.plan.num_heads, context,
                                             executor.model.embed_tokens.weight.dtype, device)
        return decode_num_splits(batch, layout.num_kv_heads, layout.head_dim, context, device)

    def key_for(self, batch: ScheduledBatch) -> GraphKey | None:
        """The graph that runs this batch, or None (not uniform, or no graph of its size)."""
        if not batch.seqs:
            return None
        q = batch.num_new_tokens[0]
        buckets = self.buckets.get(q)
        if not buckets or len(batch) > buckets[-1]:
            return None
        blocks = 0
        for s, n in zip(batch.seqs, batch.num_new_tokens):
            if n != q or s.num_computed_tokens + n != s.num_tokens + len(s.spec_token_ids):
                return None
            blocks = max(blocks, len(s.block_ids))
        bucket = next(b for b in buckets if b >= len(batch))
        return bucket, q, next(w for w in self.tiers[bucket] if w >= blocks)

    def bucket_for(self, batch_size: int, q: int) -> int | None:
        """The bucket a batch of `batch_size` sequences of q tokens replays (None: none)."""
        return next((b for b in self.buckets.get(q, ()) if b >= batch_size), None)

    def capture(self) -> None:
        """Capture every graph, largest first so the smaller ones reuse its memory pool,
        then time one replay of each (bucket, q) at its widest tier (`replay_ms`)."""
        start = time.perf_counter()
        pool_handle = torch.cuda.graph_pool_handle()
        keys = [(b, q, w) for q, bs in self.buckets.items() for b in bs for w in self.tiers[b]]
        for bucket, q, width in sorted(keys, key=lambda k: (k[0] * k[1], k[2]), reverse=True):
            step_inputs = self.inputs.graph_inputs(bucket, width, q)
            self.executor.forward(step_inputs, every_row=True)  # warm up: Triton compiles outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool_handle):
                logits = self.executor.forward(step_inputs, every_row=True)
            assert logits is not None
            self._graphs[bucket, q, width] = _Graph(graph, logits)
        torch.cuda.synchronize()
        for q, bs in self.buckets.items():
            for b in bs:
                self.replay_ms[b, q] = self._time((b, q, self.tiers[b][-1]))
        self.num_replays.clear()
        logger.info("captured %d CUDA graphs (tokens per sequence %s, batch sizes %s) in %.1f s",
                    len(self._graphs), self.tokens_per_seq, self.buckets[1] if 1 in self.buckets else [],
                    time.perf_counter() - start)

    def replay(self, key: GraphKey) -> torch.Tensor:
        """Run the graph of `key` (from `key_for`) on the inputs built for its bucket; float32
        logits [bucket * q, vocab], valid until the next replay. Raises (before any launch)
        if the inputs were last built for another layout."""
        g = self._graphs[key]
        self.inputs.check_graph_layout(key[0], key[2], key[1])
        g.graph.replay()
        self.num_replays[key[1]] = self.num_replays.get(key[1], 0) + 1
        return g.logits

    def _time(self, key: GraphKey, iters: int = 3) -> float:
        """GPU milliseconds of one replay (padding inputs: no sequence attends to anything,
        so this is the weights' and launches' cost; attention adds its KV read)."""
        self.inputs.graph_inputs(key[0], key[2], key[1])
        self.replay(key)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(iters):
            self.replay(key)
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / iters
