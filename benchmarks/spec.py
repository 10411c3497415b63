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
import datetime
import json
import os
import platform
import time
from dataclasses import asdict, dataclass

import torch

from benchmarks.spec_passes import PassCost, pass_costs, sync
from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.speculative import SpecDecoder, build_speculator, expected_speedup, expected_tokens_per_pass
from pdserve.engine.speculative.draft_model import ModelDrafter

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


def decode_rate(engine: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    """Decode tokens/s over the prompts, one request at a time, the prompt's pass excluded."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    elapsed, tokens = 0.0, 0
    for prompt in prompts:
        engine.add_request(prompt, params)
        engine.step()  # the prompt's pass: the first token
        sync(engine.device)
        t = time.perf_counter()
        while engine.has_unfinished:
            tokens += sum(len(d.token_ids) for d in engine.step())
        sync(engine.device)
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
        engine.speculate(None)
        decode_rate(engine, prompts[:1], 8)  # warm up
        base, _ = decode_rate(engine, prompts, max_tokens)
        print(f"{workload}: no speculation {base:.1f} tok/s")
        for name, spec in specs.items():
            engine.speculate(spec)
            speculator = engine.speculator
            assert isinstance(speculator, SpecDecoder)
            rate, _ = decode_rate(engine, prompts, max_tokens)
            engine.speculate(None)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--draft", default=None, help="draft model source (default: the target itself)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--num-draft-layers", type=int, default=8, help="layers of the self-draft")
    ap.add_argument("--draft-vocab-size", type=int, default=None,
                    help="the model drafters' heads keep only N token ids (SpecConfig.draft_vocab_size)")
    ap.add_argument("--draft-vocab-file", default=None,
                    help="token ids, most frequent first, that --draft-vocab-size cuts (SpecConfig.draft_vocab_file)")
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
                    help="batch sizes whose cases at the first α run once more under cProfile (untimed)")
    args = ap.parse_args()
    if args.controlled:  # its own module (imports this one's pass costs, hence here)
        from benchmarks.spec_controlled import main_controlled
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
                                 num_speculative_tokens=args.k, draft_vocab_size=args.draft_vocab_size,
                                 draft_vocab_file=args.draft_vocab_file),
        "draft_model": SpecConfig(method="draft_model", draft_model=draft, num_speculative_tokens=args.k,
                                  draft_vocab_size=args.draft_vocab_size, draft_vocab_file=args.draft_vocab_file),
    }
    drafters = {}
    for name in ("self_draft", "draft_model"):
        speculator = build_speculator(engine.parts, engine.config, specs[name])
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
          f"self-draft {args.num_draft_layers}/{engine.arch.num_layers} layers, "
          f"draft vocabulary {args.draft_vocab_size or engine.arch.vocab_size}; {machine}; "
          f"{datetime.date.today()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": str(datetime.date.today()), "machine": machine, "device": str(engine.device),
                       "model": engine.model_name, "draft": draft, "k": args.k,
                       "draft_vocab_size": args.draft_vocab_size, "draft_vocab_file": args.draft_vocab_file,
                       "costs": [asdict(c) for c in costs], "runs": [asdict(r) for r in runs]}, f, indent=1)




if __name__ == "__main__":
    main()
