"""Speculative decoding at controlled acceptance: `python -m benchmarks.spec --controlled`
(see benchmarks/spec.py's docstring for what it measures and how).

The draft model runs every draft step and pays its full cost; its proposals are replaced
by the target's own greedy continuation with probability α (`ControlledDrafter`), so the
mechanism's speedup is measured where no trained draft exists.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import pstats
import random
import time
from dataclasses import asdict, dataclass

import torch

from benchmarks.spec_passes import pass_costs, sync
from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sampler import on_device
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.speculative import SpecDecoder, expected_tokens_per_pass
from pdserve.engine.speculative.draft_loading import DraftTarget, draft_head_ids, load_draft_model
from pdserve.engine.speculative.draft_model import ModelDrafter
from pdserve.engine.speculative.factory import draft_target


class ControlledDrafter(ModelDrafter):
    """A model drafter whose proposals are the target's known continuation, each replaced by
    a wrong token with probability 1 - alpha (see `--controlled`). The draft model still
    runs every step: only its choice of token is overridden."""

    def __init__(self, model, target: DraftTarget, name: str, alpha: float, oracle: dict[str, list[int]],
                 head_ids: torch.Tensor | None = None) -> None:
        super().__init__(model, target, name, head_ids)
        self.alpha = alpha
        self.oracle = oracle
        self.vocab = target.arch.vocab_size
        self.rng = random.Random(0)

    def _draw(self, seqs, step, logits, with_probs):
        super()._draw(seqs, step, logits, with_probs)  # paid for, then overridden
        ids = []
        for seq in seqs:
            continuation = self.oracle[seq.request_id]
            right = continuation[min(seq.num_output_tokens + step, len(continuation) - 1)]
            ids.append(right if self.rng.random() < self.alpha else (right + 1) % self.vocab)
        return on_device(ids, torch.int64, self.device), None


@dataclass(frozen=True, slots=True)
class ControlledRun:
    batch: int
    k: int
    target_alpha: float
    adaptive: bool
    alpha: float
    tokens_per_pass: float
    v: float
    c: float
    tokens_per_s: float
    baseline_tokens_per_s: float
    speedup: float
    predicted_speedup: float  # (1 - a^(K+1)) / (1 - a) / (v + K c), from the measured a, v, c
    steps_by_k: dict[int, int]
    matched: float  # share of output tokens equal to the baseline's before the first difference


def _batch_rate(engine: Engine, prompts: list[list[int]], max_tokens: int, ids: list[str]
                ) -> tuple[float, dict[str, list[int]]]:
    """Decode tokens/s of the prompts as one batch (their prompt pass excluded), and the outputs."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for rid, prompt in zip(ids, prompts):
        engine.add_request(prompt, params, request_id=rid)
    outputs: dict[str, list[int]] = {rid: [] for rid in ids}
    while any(not out for out in outputs.values()):  # every prompt's pass: its first token
        for d in engine.step():
            outputs[d.request_id] += d.token_ids
    sync(engine.device)
    t, tokens = time.perf_counter(), 0
    while engine.has_unfinished:
        for d in engine.step():
            outputs[d.request_id] += d.token_ids
            tokens += len(d.token_ids)
    sync(engine.device)
    return tokens / (time.perf_counter() - t), outputs


def _counters(engine: Engine, drafter: ModelDrafter, since: tuple | None = None) -> tuple:
    """Eager forwards and graph replays by q of the target and the draft (minus `since`)."""
    now = []
    for runner in (engine.runner, drafter.runner):
        now += [runner.num_eager_steps, dict(runner.graphs.num_replays) if runner.graphs is not None else {}]
    if since is None:
        return tuple(now)
    return tuple(n - s if isinstance(n, int) else {q: v - s.get(q, 0) for q, v in n.items()}
                 for n, s in zip(now, since))


def _matched(oracle: dict[str, list[int]], outputs: dict[str, list[int]]) -> float:
    """The share of output tokens equal to the baseline's before each request's first difference.

    Greedy speculation is exact (tests/engine/test_gpu.py checks it in float32), but dummy
    weights give a near-flat distribution (top logprob ~ -7 over 128k tokens), whose argmax
    bf16 rounding decides: a pass of other GEMM shapes (K + 1 tokens per sequence, another
    batch size) may flip it, and even plain decoding differs between batch 1 and batch 8.
    Past a request's first difference its proposals no longer follow its own continuation,
    so its acceptance falls below the target α: the measured α is what the table reports."""
    matched = total = 0
    for rid, want in oracle.items():
        got = outputs[rid]
        matched += next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        total += len(want)
    return matched / total


def make_greedy_chain(model: torch.nn.Module, seed: int = 0, layer_scale: float = 1e-4) -> None:
    """Dummy weights whose greedy continuation bf16 rounding cannot flip (see `--controlled`).

    The layers' output projections are scaled down, so the residual stream stays the current
    token's embedding, and the head is the embedding permuted, so the next token is a fixed
    function of the current one with a wide margin: |e|^2 ~ 1.6 against ~0.12 for the best
    other of 128k random rows (std 0.02, hidden 4096), while every layer's contribution is
    ~1e-4 of what random weights give. Every pass still reads and multiplies every weight:
    the costs are those of the real shapes."""
    if model.lm_head.weight is model.embed_tokens.weight:
        raise ValueError("--chain needs a model whose head is not tied to its embedding; pass --no-chain")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.o_proj.weight.mul_(layer_scale)
            layer.mlp.down_proj.weight.mul_(layer_scale)
        embed = model.embed_tokens.weight
        perm = torch.randperm(embed.shape[0], generator=gen).to(embed.device)
        model.lm_head.weight.copy_(embed[perm])


def _speculate(engine: Engine, drafter: ControlledDrafter, k: int, alpha: float, adaptive: bool,
               cost_ratio: float) -> SpecDecoder:
    """Speculate with `drafter` from now on, afresh for one case (its acceptance and random
    draws reset), through the engine's builder; returns the speculator. Without graphs adaptive
    K weighs each proposed token at `cost_ratio` of a decode step."""
    drafter.alpha, drafter.rng = alpha, random.Random(2)
    engine.speculate(_config(k, adaptive, cost_ratio), drafter=drafter)
    return engine.speculator


def _config(k: int, adaptive: bool = False, cost_ratio: float = 0.3) -> SpecConfig:
    # The method is the drafter's own (`Engine.speculate`'s drafter): "ngram" only turns it on.
    return SpecConfig(method="ngram", num_speculative_tokens=k, adaptive=adaptive, verify_cost=cost_ratio)


def _host_profile(engine: Engine, prompts: list[list[int]], max_tokens: int, ids: list[str], label: str) -> None:
    """One more run of a case under cProfile, apart from the timed one (the engine speculates
    as the case does): the profiler slows the host several-fold, which a host-bound step shows
    as a lower speedup."""
    profiler = cProfile.Profile()
    profiler.enable()
    _batch_rate(engine, prompts, max_tokens, ids)
    profiler.disable()
    engine.speculate(None)
    print(f"host profile, {label} (cProfile, cumulative, pdserve's own; an untimed run):")
    pstats.Stats(profiler).sort_stats("cumulative").print_stats("pdserve", 40)


def controlled(engine: Engine, args: argparse.Namespace) -> list[ControlledRun]:
    k, vocab = args.k, engine.arch.vocab_size
    if args.chain:
        make_greedy_chain(engine.model)
    target = draft_target(engine.parts, engine.config)
    draft_model = load_draft_model(args.draft or args.model, target)
    head_ids = draft_head_ids(engine.config.spec, vocab)
    rng = random.Random(1)
    runs = []
    for batch in args.batches:
        prompts = [[rng.randrange(vocab) for _ in range(args.context)] for _ in range(batch)]
        ids = [f"b{batch}-{i}" for i in range(batch)]
        engine.speculate(None)
        _batch_rate(engine, prompts[:1], 4, ["warm-up"])
        base, oracle = _batch_rate(engine, prompts, args.max_tokens, ids)
        print(f"batch {batch}: no speculation {base:.1f} tok/s")
        drafter = ControlledDrafter(draft_model, target, args.draft or args.model, 1.0, oracle, head_ids)
        # Warm up: the draft's own kernels compile on its first prompt and on the catch-ups
        # of every length adaptive K's pauses leave (eager steps of new shapes).
        drafter.alpha = 0.5
        for adaptive in (False, True):
            engine.speculate(_config(k, adaptive), drafter=drafter)
            _batch_rate(engine, prompts[:1], 48, [ids[0]])
        engine.speculate(None)
        costs = pass_costs(engine, {"draft": drafter}, k, [batch], args.context, args.iters)
        v = costs[0].verify_ms / costs[0].decode_ms
        c = costs[1].decode_ms / costs[0].decode_ms
        # The oracle under the numerics of verification passes: the output of speculating with
        # the oracle itself (α = 1), again until it reproduces itself (see `_matched`). These
        # runs also compile what the batch's shapes need outside the timed ones.
        drafter.alpha = 1.0
        for _ in range(args.oracle_iterations):
            drafter.rng = random.Random(2)
            engine.speculate(_config(k), drafter=drafter)
            _, outputs = _batch_rate(engine, prompts, args.max_tokens, ids)
            engine.speculate(None)
            if outputs == drafter.oracle:
                break
            drafter.oracle = oracle = outputs
        cases = [(a, False) for a in args.alphas] + [(a, True) for a in args.alphas]
        for alpha, adaptive in cases:
            cost, mode = c + (v - 1) / k, "adaptive" if adaptive else f"K={k}"
            if batch in args.profile and alpha == args.alphas[0]:
                _speculate(engine, drafter, k, alpha, adaptive, cost)
                _host_profile(engine, prompts, args.max_tokens, ids, f"batch {batch}, {mode}")
            spec = _speculate(engine, drafter, k, alpha, adaptive, cost)
            counters = _counters(engine, drafter)
            rate, outputs = _batch_rate(engine, prompts, args.max_tokens, ids)
            engine.speculate(None)
            print(f"  steps served (target eager, by q; draft eager, by q): {_counters(engine, drafter, counters)}")
            matched = _matched(oracle, outputs)
            m = spec.metrics
            predicted = expected_tokens_per_pass(m.alpha, k) / (v + k * c)
            runs.append(ControlledRun(batch, k, alpha, adaptive, m.alpha, m.mean_tokens_per_pass, v, c, rate, base,
                                      rate / base, predicted, dict(m.num_steps_by_k), matched))
            print(f"batch {batch}: alpha {alpha} {mode}: {rate:.1f} tok/s "
                  f"({rate / base:.2f}x, predicted {predicted:.2f}x), K chosen {dict(m.num_steps_by_k)}")
        del drafter
    return runs


def print_controlled(runs: list[ControlledRun]) -> None:
    print("\nacceptance-controlled, greedy (same as baseline: the share of tokens before a bf16 flip), "
          "baseline = no speculation, same run\n")
    print("| batch | K | target α | α | tokens/pass | v | c | tok/s | baseline tok/s | speedup | formula (v+Kc) "
          "| measured / formula | steps by K | same as baseline |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for r in runs:
        k = "adaptive" if r.adaptive else str(r.k)
        print(f"| {r.batch} | {k} | {r.target_alpha:.2f} | {r.alpha:.3f} | {r.tokens_per_pass:.2f} | {r.v:.3f} | "
              f"{r.c:.3f} | {r.tokens_per_s:.1f} | {r.baseline_tokens_per_s:.1f} | {r.speedup:.2f}x | "
              f"{r.predicted_speedup:.2f}x | {r.speedup / r.predicted_speedup:.2f} | {r.steps_by_k} | "
              f"{r.matched:.1%} |")


def main_controlled(args: argparse.Namespace) -> None:
    block_size = CacheConfig().block_size
    batch = max(args.batches)
    num_blocks = args.num_blocks or batch * -(-(args.context + args.max_tokens + 2 * args.k) // block_size) + 64
    spec = SpecConfig(method="draft_model", draft_model=args.draft or args.model, num_speculative_tokens=args.k,
                      draft_vocab_size=args.draft_vocab_size, draft_vocab_file=args.draft_vocab_file)
    engine = Engine(EngineConfig(model=ModelConfig(source=args.model, device=args.device),
                                 cache=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                                   enable_prefix_caching=False),
                                 scheduler=SchedulerConfig(max_num_seqs=max(8, batch)), spec=spec))
    runs = controlled(engine, args)
    print_controlled(runs)
    print(f"\n{engine.model_name} on {engine.device} ({engine.dtype}), draft {args.draft or args.model}, "
          f"draft vocabulary {args.draft_vocab_size or engine.arch.vocab_size}, context {args.context}, "
          f"{args.max_tokens} tokens per request; {datetime.date.today()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": str(datetime.date.today()), "model": engine.model_name, "draft": args.draft,
                       "draft_vocab_size": args.draft_vocab_size, "draft_vocab_file": args.draft_vocab_file,
                       "runs": [asdict(r) for r in runs]}, f, indent=1)

