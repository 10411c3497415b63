"""What a speculative pass costs: a decode step and a K + 1-token verification of the target,
a draft's step, each timed alone over a batch at a context (`pass_costs`). Shared by
`benchmarks.spec` and `benchmarks.spec_controlled`."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch

from pdserve.engine.engine import Engine
from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.runner.model_runner import ModelRunner
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine.sequence import Sequence
from pdserve.engine.speculative.draft_model import ModelDrafter


@dataclass(frozen=True, slots=True)
class PassCost:
    model: str
    batch: int
    decode_ms: float  # one step, one token per sequence
    verify_ms: float | None  # one pass over K+1 tokens per sequence (targets only)



def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_pass(runner: ModelRunner, bm: BlockManager, vocab: int, batch: int, context: int, num_new: int,
              iters: int) -> float:
    """Milliseconds of one forward over `batch` sequences of `context` tokens, each
    advancing by `num_new` (1: a decode step; K+1: a verification pass)."""
    rng = random.Random(0)
    seqs = []
    for i in range(batch):
        prompt = tuple(rng.randrange(vocab) for _ in range(context))
        seq = Sequence(f"bench-{i}", prompt, SamplingParams(), bm.block_size)
        seq.spec_token_ids = [rng.randrange(vocab) for _ in range(num_new - 1)]
        if not bm.allocate(seq, context - 1 + num_new):
            raise ValueError("KV pool too small for the pass-cost benchmark")
        seq.num_computed_tokens = context - 1  # the context's KV is garbage, its cost is not
        seqs.append(seq)
    sched = ScheduledBatch(seqs, [num_new] * batch)
    device = runner.device
    try:
        for _ in range(2):
            runner.compute_logits(sched)
        sync(device)
        t = time.perf_counter()
        for _ in range(iters):
            runner.compute_logits(sched)
        sync(device)
        return (time.perf_counter() - t) / iters * 1e3
    finally:
        for seq in seqs:
            bm.free(seq)


def pass_costs(engine: Engine, drafters: dict[str, ModelDrafter], k: int, batches: list[int], context: int,
               iters: int) -> list[PassCost]:
    vocab = engine.arch.vocab_size
    rows = []
    for b in batches:
        decode = time_pass(engine.runner, engine.block_manager, vocab, b, context, 1, iters)
        verify = time_pass(engine.runner, engine.block_manager, vocab, b, context, k + 1, iters)
        rows.append(PassCost("target", b, decode, verify))
        for name, d in drafters.items():
            rows.append(PassCost(name, b, time_pass(d.runner, d.block_manager, vocab, b, context, 1, iters), None))
    return rows
