"""Speculative decoding: acceptance, tokens/s and speedup per drafter, against the formula.

    python -m benchmarks.spec [--device cpu] [--k 4] [--num-draft-layers 8] [--json PATH]
    python -m benchmarks.spec --device cuda --model dummy:llama-3.1-8b --draft dummy:llama-3.2-1b --json PATH

Two parts:
- Pass costs (every device): one target decode step (1 token per sequence),
  one target verification pass (K+1 tokens per sequence, the prefill path),
  and one decode step of each model drafter, at batch 1 and --batch-size;
  c = draft step / target decode step, v = verification pass / target decode
  step (the formula assumes v = 1: memory-bound decoding).
- End to end (models with a tokenizer): greedy decoding of chat prompts and of
  prompts that invite copying (summaries, code edits), one request at a time,
  with no speculation, n-gram lookup (fixed K, and adaptive K), the self-draft
  and the draft model, in the same run. Decode tokens/s (the prompt's pass excluded), the measured α,
  tokens per pass, the speedup, and the speedup the formula predicts from the
  measured α and c: (1 - a^(K+1)) / (1 - a) / (1 + K c), and with the
  measured verification cost: ... / (v + K c).

`--json` writes the runs in the form `pdserve spec-sim --measured` reads.

    python -m benchmarks.spec --controlled --device cuda --model dummy:llama-3.1-8b --draft dummy:llama-3.2-1b

`--controlled`: acceptance under control, for models without a trained draft (dummy
weights accept almost nothing). The target's greedy continuation of each prompt is
computed first (that run is the baseline: no speculation); then the real draft model runs
every draft step, paying its full cost, but each token it proposes is replaced by the
target's own next token with probability α and by a wrong one otherwise. Greedy
verification then accepts with probability α per token, and the output must equal the
baseline's. Per batch size: v, c, tokens per pass, tok/s, the measured speedup and the
formula's prediction from the measured α, v and c; and adaptive K at the same α.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import os
import platform
import pstats
import random
import time
from dataclasses import asdict, dataclass

import torch

from pdserve.decode_node.spec import SpecDecoder, build_speculator, expected_speedup, expected_tokens_per_pass
from pdserve.decode_node.spec.adaptive import AdaptiveK, MeasuredCosts, RelativeCosts
from pdserve.decode_node.spec.draft_model import ModelDrafter, load_draft_model
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from pdserve.engine.engine import Engine
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.sampler import on_device
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine.sequence import Sequence

CHAT = [
    "What are three good habits for staying healthy? Answer briefly.",
    "Explain what a compiler does to a ten-year-old.",
    "Write a short poem about the sea.",
]
PASSAGE = (
    "The history of computing is a story of abstraction. Early machines were programmed by rewiring panels of "
    "cables; later, stored programs let a single machine perform many tasks. Compilers translated human-readable "
    "languages into machine code, operating systems shared the hardware between many users, and networks "
    "connected machines across continents. Each layer hid the one below it, and each made the next possible."
)
CODE = '''def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)


def variance(values):
    m = mean(values)
    return sum((v - m) ** 2 for v in values) / len(values)
'''
COPY = [
    f"Summarize the following text, reusing its own words:\n\n{PASSAGE}",
    f"Rename the function `mean` to `average` in this code and print the whole corrected code:\n\n{CODE}",
    f"Repeat the following paragraph exactly, then say how many sentences it has:\n\n{PASSAGE}",
]


@dataclass(frozen=True, slots=True)
class PassCost:
    model: str
    batch: int
    decode_ms: float  # one step, one token per sequence
    verify_ms: float | None  # one pass over K+1 tokens per sequence (targets only)


@dataclass(frozen=True, slots=True)
class Run:
    drafter: str
    workload: str
    k: int
    alpha: float
    cost_ratio: float
    verify_cost: float
    tokens_per_pass: float
    tokens_per_s: float
    baseline_tokens_per_s: float
    speedup: float
    predicted_speedup: float
    predicted_speedup_measured_verify: float


def _sync(device: torch.device) -> None:
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
        _sync(device)
        t = time.perf_counter()
        for _ in range(iters):
            runner.compute_logits(sched)
        _sync(device)
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


def decode_rate(engine: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    """Decode tokens/s over the prompts, one request at a time, the prompt's pass excluded."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    elapsed, tokens = 0.0, 0
    for prompt in prompts:
        engine.add_request(prompt, params)
        engine.step()  # the prompt's pass: the first token
        _sync(engine.device)
        t = time.perf_counter()
        while engine.has_unfinished:
            tokens += sum(len(d.token_ids) for d in engine.step())
        _sync(engine.device)
        elapsed += time.perf_counter() - t
    return tokens / elapsed, tokens


def end_to_end(engine: Engine, specs: dict[str, SpecConfig], costs: list[PassCost], k: int,
               max_tokens: int) -> list[Run]:
    target = next(c for c in costs if c.model == "target" and c.batch == 1)
    verify_cost = target.verify_ms / target.decode_ms
    workloads = {
        "chat": [engine.apply_chat_template([{"role": "user", "content": p}]) for p in CHAT],
        "copy": [engine.apply_chat_template([{"role": "user", "content": p}]) for p in COPY],
    }
    runs = []
    for workload, prompts in workloads.items():
        engine.set_speculator(None)
        decode_rate(engine, prompts[:1], 8)  # warm up
        base, _ = decode_rate(engine, prompts, max_tokens)
        print(f"{workload}: no speculation {base:.1f} tok/s")
        for name, spec in specs.items():
            speculator = build_speculator(engine, spec)
            assert isinstance(speculator, SpecDecoder)
            engine.set_speculator(speculator)
            rate, _ = decode_rate(engine, prompts, max_tokens)
            engine.set_speculator(None)
            m = speculator.metrics
            draft = next((c for c in costs if c.model == name and c.batch == 1), None)
            c = draft.decode_ms / target.decode_ms if draft else 0.0
            alpha = m.alpha
            runs.append(Run(name, workload, k, alpha, c, verify_cost, m.mean_tokens_per_pass, rate, base,
                            rate / base, expected_speedup(alpha, k, c),
                            expected_tokens_per_pass(alpha, k) / (verify_cost + k * c)))
            print(f"{workload}: {name} {rate:.1f} tok/s, alpha {alpha:.3f}")
    return runs


def print_tables(costs: list[PassCost], runs: list[Run], k: int) -> None:
    print(f"\npass costs (K={k})\n")
    print("| model | batch | decode step ms | verify K+1 ms | K decode steps ms | verify / decode | c |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in costs:
        target = next(c for c in costs if c.model == "target" and c.batch == row.batch)
        verify = f"{row.verify_ms:.1f}" if row.verify_ms is not None else "-"
        ratio = f"{row.verify_ms / row.decode_ms:.2f}" if row.verify_ms is not None else "-"
        c = f"{row.decode_ms / target.decode_ms:.3f}" if row.model != "target" else "-"
        print(f"| {row.model} | {row.batch} | {row.decode_ms:.1f} | {verify} | {k * row.decode_ms:.1f} "
              f"| {ratio} | {c} |")
    if not runs:
        return
    print("\nend to end, greedy, batch 1 (decode tokens/s; baseline = no speculation, same run)\n")
    print("| workload | drafter | alpha | tokens/pass | tok/s | baseline tok/s | speedup | formula (1+Kc) "
          "| formula (v+Kc) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in runs:
        print(f"| {r.workload} | {r.drafter} | {r.alpha:.3f} | {r.tokens_per_pass:.2f} | {r.tokens_per_s:.1f} | "
              f"{r.baseline_tokens_per_s:.1f} | {r.speedup:.2f}x | {r.predicted_speedup:.2f}x | "
              f"{r.predicted_speedup_measured_verify:.2f}x |")


class ControlledDrafter(ModelDrafter):
    """A model drafter whose proposals are the target's known continuation, each replaced by
    a wrong token with probability 1 - alpha (see `--controlled`). The draft model still
    runs every step: only its choice of token is overridden."""

    def __init__(self, model, target: Engine, name: str, alpha: float, oracle: dict[str, list[int]]) -> None:
        super().__init__(model, target, name)
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
    _sync(engine.device)
    t, tokens = time.perf_counter(), 0
    while engine.has_unfinished:
        for d in engine.step():
            outputs[d.request_id] += d.token_ids
            tokens += len(d.token_ids)
    _sync(engine.device)
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


def _costs(engine: Engine, drafter: ModelDrafter, cost_ratio: float = 0.3) -> MeasuredCosts | RelativeCosts:
    """What adaptive K weighs: the graphs' replay times, or without graphs `cost_ratio`."""
    graphs = engine.runner.graphs
    return MeasuredCosts(graphs, drafter.runner.graphs) if graphs is not None else RelativeCosts(cost_ratio)


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


def controlled(engine: Engine, args: argparse.Namespace) -> list[ControlledRun]:
    k, vocab = args.k, engine.arch.vocab_size
    if args.chain:
        make_greedy_chain(engine.model)
    draft_model = load_draft_model(args.draft or args.model, engine)
    rng = random.Random(1)
    runs = []
    for batch in args.batches:
        prompts = [[rng.randrange(vocab) for _ in range(args.context)] for _ in range(batch)]
        ids = [f"b{batch}-{i}" for i in range(batch)]
        engine.set_speculator(None)
        _batch_rate(engine, prompts[:1], 4, ["warm-up"])
        base, oracle = _batch_rate(engine, prompts, args.max_tokens, ids)
        print(f"batch {batch}: no speculation {base:.1f} tok/s")
        drafter = ControlledDrafter(draft_model, engine, args.draft or args.model, 1.0, oracle)
        # Warm up: the draft's own kernels compile on its first prompt and on the catch-ups
        # of every length adaptive K's pauses leave (eager steps of new shapes).
        drafter.alpha = 0.5
        for warm in (SpecDecoder(drafter, engine.sampler, k), SpecDecoder(
                drafter, engine.sampler, k, AdaptiveK(k, _costs(engine, drafter)))):
            engine.set_speculator(warm)
            _batch_rate(engine, prompts[:1], 48, [ids[0]])
        engine.set_speculator(None)
        costs = pass_costs(engine, {"draft": drafter}, k, [batch], args.context, args.iters)
        v = costs[0].verify_ms / costs[0].decode_ms
        c = costs[1].decode_ms / costs[0].decode_ms
        # The oracle under the numerics of verification passes: the output of speculating with
        # the oracle itself (α = 1), again until it reproduces itself (see `_matched`). These
        # runs also compile what the batch's shapes need outside the timed ones.
        drafter.alpha = 1.0
        for _ in range(args.oracle_iterations):
            drafter.rng = random.Random(2)
            engine.set_speculator(SpecDecoder(drafter, engine.sampler, k))
            _, outputs = _batch_rate(engine, prompts, args.max_tokens, ids)
            engine.set_speculator(None)
            if outputs == drafter.oracle:
                break
            drafter.oracle = oracle = outputs
        cases = [(a, False) for a in args.alphas] + [(a, True) for a in args.alphas]
        for alpha, adaptive in cases:
            drafter.alpha, drafter.rng = alpha, random.Random(2)
            ada = AdaptiveK(k, _costs(engine, drafter, c + (v - 1) / k)) if adaptive else None
            spec = SpecDecoder(drafter, engine.sampler, k, ada)
            engine.set_speculator(spec)
            counters = _counters(engine, drafter)
            profiler = cProfile.Profile() if batch in args.profile and alpha == args.alphas[0] else None
            if profiler is not None:
                profiler.enable()
            rate, outputs = _batch_rate(engine, prompts, args.max_tokens, ids)
            if profiler is not None:
                profiler.disable()
                mode = "adaptive" if adaptive else f"K={k}"
                print(f"host profile, batch {batch}, {mode} (cProfile, cumulative, pdserve's own):")
                pstats.Stats(profiler).sort_stats("cumulative").print_stats("pdserve", 40)
            engine.set_speculator(None)
            print(f"  steps served (target eager, by q; draft eager, by q): {_counters(engine, drafter, counters)}")
            matched = _matched(oracle, outputs)
            m = spec.metrics
            predicted = expected_tokens_per_pass(m.alpha, k) / (v + k * c)
            runs.append(ControlledRun(batch, k, alpha, adaptive, m.alpha, m.mean_tokens_per_pass, v, c, rate, base,
                                      rate / base, predicted, dict(m.num_steps_by_k), matched))
            print(f"batch {batch}: alpha {alpha} {'adaptive' if adaptive else f'K={k}'}: {rate:.1f} tok/s "
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--draft", default=None, help="draft model source (default: the target itself)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--num-draft-layers", type=int, default=8, help="layers of the self-draft")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8, help="second batch size of the pass-cost table")
    ap.add_argument("--context", type=int, default=512, help="context length in the pass-cost table")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--num-blocks", type=int, default=None,
                    help="KV blocks of the target (and of each draft); default: what the pass-cost table needs")
    ap.add_argument("--json", default=None)
    ap.add_argument("--controlled", action="store_true", help="acceptance-controlled runs (see above)")
    ap.add_argument("--alphas", type=float, nargs="+", default=[0.6, 0.8, 0.9])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--oracle-iterations", type=int, default=4,
                    help="speculative runs at α = 1 that refine the oracle (--controlled)")
    ap.add_argument("--chain", action=argparse.BooleanOptionalAction, default=True,
                    help="dummy target weights with a stable greedy chain (--controlled; see make_greedy_chain)")
    ap.add_argument("--profile", type=int, nargs="*", default=[],
                    help="batch sizes whose first controlled runs are profiled on the host (cProfile)")
    args = ap.parse_args()
    if args.controlled:
        main_controlled(args)
        return

    # A fixed pool, not one sized from free memory: each model drafter allocates one as large again.
    block_size = CacheConfig().block_size
    num_blocks = args.num_blocks or max(1024, args.batch_size * -(-(args.context + args.k) // block_size))
    engine = Engine(EngineConfig(model=ModelConfig(source=args.model, device=args.device),
                                 cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
                                 scheduler=SchedulerConfig(max_num_seqs=max(8, args.batch_size))))
    draft = args.draft or args.model
    specs = {
        "ngram": SpecConfig(method="ngram", num_speculative_tokens=args.k),
        "self_draft": SpecConfig(method="self_draft", num_draft_layers=args.num_draft_layers,
                                 num_speculative_tokens=args.k),
        "draft_model": SpecConfig(method="draft_model", draft_model=draft, num_speculative_tokens=args.k),
    }
    drafters = {}
    for name in ("self_draft", "draft_model"):
        speculator = build_speculator(engine, specs[name])
        assert isinstance(speculator, SpecDecoder) and isinstance(speculator.drafter, ModelDrafter)
        drafters[name] = speculator.drafter
    costs = pass_costs(engine, drafters, args.k, [1, args.batch_size], args.context, args.iters)
    del drafters
    target = costs[0]
    # Adaptive K weighs each proposed token's marginal verification cost, measured above.
    specs["ngram_adaptive"] = SpecConfig(method="ngram", num_speculative_tokens=args.k, adaptive=True,
                                         verify_cost=max(0.0, (target.verify_ms / target.decode_ms - 1) / args.k))
    runs = end_to_end(engine, specs, costs, args.k, args.max_tokens) if engine.tokenizer is not None else []
    print_tables(costs, runs, args.k)
    machine = (f"{platform.node()}: {platform.machine()}, {os.cpu_count()} CPUs"
               + (f", {torch.cuda.get_device_name(engine.device)}" if engine.device.type == "cuda" else ""))
    print(f"\n{engine.model_name} on {engine.device} ({engine.dtype}), draft {draft}, "
          f"self-draft {args.num_draft_layers}/{engine.arch.num_layers} layers; {machine}; "
          f"{datetime.date.today()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": str(datetime.date.today()), "machine": machine, "device": str(engine.device),
                       "model": engine.model_name, "draft": draft, "k": args.k,
                       "costs": [asdict(c) for c in costs], "runs": [asdict(r) for r in runs]}, f, indent=1)


def main_controlled(args: argparse.Namespace) -> None:
    block_size = CacheConfig().block_size
    batch = max(args.batches)
    num_blocks = args.num_blocks or batch * -(-(args.context + args.max_tokens + 2 * args.k) // block_size) + 64
    spec = SpecConfig(method="draft_model", draft_model=args.draft or args.model, num_speculative_tokens=args.k)
    engine = Engine(EngineConfig(model=ModelConfig(source=args.model, device=args.device),
                                 cache=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                                   enable_prefix_caching=False),
                                 scheduler=SchedulerConfig(max_num_seqs=max(8, batch)), spec=spec))
    runs = controlled(engine, args)
    print_controlled(runs)
    print(f"\n{engine.model_name} on {engine.device} ({engine.dtype}), draft {args.draft or args.model}, "
          f"context {args.context}, {args.max_tokens} tokens per request; {datetime.date.today()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": str(datetime.date.today()), "model": engine.model_name, "draft": args.draft,
                       "runs": [asdict(r) for r in runs]}, f, indent=1)


if __name__ == "__main__":
    main()
