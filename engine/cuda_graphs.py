"""CUDA graphs for decode-only steps, one per batch-size bucket and context tier.

A decode step of a large model is hundreds of small kernel launches; replaying
a captured graph removes Python and launch overhead from the critical path.
Inputs live in the step-input builder's fixed buffers; a batch is padded up to its
bucket with rows that write nothing (slot -1) and attend to nothing (context length 0).

A graph fixes its attention kernel's work split, which the launcher sizes for the
longest context the block table can hold. Small batches split long contexts across the
GPU (flash-decoding), so their graphs come in context tiers: the graph of the shortest
tier that holds the batch's longest sequence replays, with splits sized for that tier
rather than for max_model_len (at batch 1 and 1k context: 8 splits, not 66).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pdserve.engine.attention import AttentionBackend
from pdserve.engine.kv_pool import KVPool
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.engine.sequence import Sequence
from pdserve.engine.step_inputs import StepInputBuilder, StepInputs
from pdserve.kernels.paged_decode import decode_num_splits

logger = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TIER_TOKENS = (2048, 8192, 32768)  # context tiers below max_model_len


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [bucket, vocab] float32, written by each replay


class DecodeGraphs:
    """Captures and replays decode-only steps. Inputs come from `StepInputBuilder.build(...,
    pad_to=bucket)`, which writes them into the views each graph was captured over."""

    def __init__(self, model: LlamaForCausalLM, pool: KVPool, backend: AttentionBackend, inputs: StepInputBuilder,
                 scale: float, max_batch: int) -> None:
        self.model = model
        self.pool = pool
        self.backend = backend
        self.inputs = inputs
        self.scale = scale
        self.buckets = [b for b in BUCKETS if b <= max_batch] or [1]
        if self.buckets[-1] < max_batch:
            self.buckets.append(max_batch)
        block_size, kv_heads = pool.layout.block_size, pool.layout.num_kv_heads
        widths = sorted({-(-t // block_size) for t in TIER_TOKENS if t < inputs.max_blocks * block_size}
                        | {inputs.max_blocks})
        # Per bucket, the tiers (block-table widths) whose attention splits differ: the
        # widest width of each split count.
        self.tiers: dict[int, list[int]] = {}
        for bucket in self.buckets:
            by_splits = {decode_num_splits(bucket, kv_heads, w * block_size, pool.kv.device): w for w in widths}
            self.tiers[bucket] = sorted(by_splits.values())
        self._graphs: dict[tuple[int, int], _Graph] = {}

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def key_for(self, seqs: list[Sequence]) -> tuple[int, int]:
        """(bucket, block-table width) of the graph that runs this decode batch."""
        bucket = next(b for b in self.buckets if b >= len(seqs))
        blocks = max(len(s.block_ids) for s in seqs)
        return bucket, next(w for w in self.tiers[bucket] if w >= blocks)

    def capture(self) -> None:
        """Capture every (bucket, tier), largest first so the smaller ones reuse its memory pool."""
        pool_handle = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.buckets):
            for width in reversed(self.tiers[bucket]):
                step_inputs = self.inputs.graph_inputs(bucket, width)
                self._forward(step_inputs)  # warm up: Triton compiles outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool_handle):
                    logits = self._forward(step_inputs)
                self._graphs[bucket, width] = _Graph(graph, logits)
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs for batch sizes %s", len(self._graphs), self.buckets)

    def replay(self, key: tuple[int, int]) -> torch.Tensor:
        """Run the graph of `key` (from `key_for`) on the inputs built for its bucket; float32
        logits [bucket, vocab], valid until the next replay."""
        g = self._graphs[key]
        g.graph.replay()
        return g.logits

    def _forward(self, step_inputs: StepInputs) -> torch.Tensor:
        step = self.backend.begin_step(step_inputs.meta, self.pool, self.scale)
        hidden = self.model(step_inputs.input_ids, step_inputs.positions, step)
        return self.model.compute_logits(hidden)
