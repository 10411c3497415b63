"""CPU Mixture of Experts: the engine's prefill and decode tokens/s on a small random
Qwen3-MoE against transformers' own forward of the same weights, in one run.

    python -m benchmarks.cpu_moe [--prompt-len 512] [--batch 8] [--new-tokens 32] [--runs 3]

The model: transformers' Qwen3MoeConfig at a small shape (hidden 256, 4 layers, 16 experts,
top 4, expert width 128; random weights, fp32), saved as a folder and loaded by both.
- prefill: one fresh prompt of --prompt-len tokens; the engine's `generate(max_tokens=1)`
  against one HF forward of the prompt (logits of every position);
- decode: --batch fresh prompts of 16 tokens each, --new-tokens greedy tokens each; the
  engine's continuous batch against HF `generate` of the batch (its KV cache, no padding:
  every prompt is 16 tokens).
Untimed warm-up first, then --runs runs of each, the two systems taking turns. Prints the
median tokens/s of each and the ratio (engine / HF). The CPU has no physical limit to
quote usefully here; HF beside it is the baseline. Times nothing in the tests.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import torch

from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sampling import SamplingParams

SHAPE = dict(vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=32, max_position_embeddings=4096, num_experts=16, num_experts_per_tok=4,
             moe_intermediate_size=128, norm_topk_prob=True, eos_token_id=None)


def _prompts(rng: random.Random, n: int, length: int) -> list[list[int]]:
    return [[rng.randrange(100, SHAPE["vocab_size"]) for _ in range(length)] for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**SHAPE), dtype=torch.float32).eval()
    folder = tempfile.mkdtemp(prefix="pdserve-cpu-moe-")
    hf.save_pretrained(folder)
    engine = Engine(EngineConfig(model=ModelConfig(source=folder, device="cpu", dtype="float32"),
                                 cache=CacheConfig(enable_prefix_caching=False, cpu_kv_cache_gib=1.0),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=4096)))
    rng = random.Random(0)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)

    def engine_prefill() -> float:
        (prompt,) = _prompts(rng, 1, args.prompt_len)
        t = time.perf_counter()
        engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
        return args.prompt_len / (time.perf_counter() - t)

    def hf_prefill() -> float:
        ids = torch.tensor(_prompts(rng, 1, args.prompt_len))
        with torch.inference_mode():
            t = time.perf_counter()
            hf(ids)
            return args.prompt_len / (time.perf_counter() - t)

    def engine_decode() -> float:
        prompts = _prompts(rng, args.batch, 16)
        t = time.perf_counter()
        outs = engine.generate(prompts, greedy)
        return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)

    def hf_decode() -> float:
        ids = torch.tensor(_prompts(rng, args.batch, 16))
        with torch.inference_mode():
            t = time.perf_counter()
            out = hf.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
            return (out.shape[1] - 16) * args.batch / (time.perf_counter() - t)

    rows = []
    for name, ours, theirs in (("prefill", engine_prefill, hf_prefill), ("decode", engine_decode, hf_decode)):
        ours(), theirs()  # warm-up
        a, b = [], []
        for _ in range(args.runs):
            a.append(ours())
            b.append(theirs())
        rows.append((name, statistics.median(a), statistics.median(b)))
    print(f"{'phase':<8} {'engine tok/s':>13} {'HF tok/s':>10} {'engine/HF':>10}")
    for name, a, b in rows:
        print(f"{name:<8} {a:>13.1f} {b:>10.1f} {a / b:>10.2f}")
    print(f"(Qwen3-MoE shape {SHAPE['hidden_size']} hidden, {SHAPE['num_hidden_layers']} layers, "
          f"{SHAPE['num_experts']} experts top {SHAPE['num_experts_per_tok']}; prompt {args.prompt_len}; "
          f"decode batch {args.batch} x {args.new_tokens}; torch threads {torch.get_num_threads()})")


if __name__ == "__main__":
    main()
