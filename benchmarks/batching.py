"""Static vs continuous batching, and HF `generate`, on one mixed-length workload.

    python benchmarks/batching.py [--num-requests 64] [--batch-size 32] [--min-output 16] [--max-output 1024]

Every request has a fixed output length (ignore EOS), drawn uniformly from
[min-output, max-output], so all three systems do the same useful work:
- static: our engine, requests in fixed batches; a batch ends when its longest
  request does (the slots of finished requests idle: padding).
- continuous: our engine, iteration-level: a finished request's slot is refilled
  at the next step.
- hf: transformers `generate` on the same static batches (left padding, every row
  runs to the batch's longest output).
Also decode tokens/s at batch 1 and at --batch-size. Prints one table.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

import torch

from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class Request:
    prompt: list[int]
    output_len: int


def make_workload(tokenizer, vocab_size: int, n: int, min_out: int, max_out: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    if tokenizer is not None:
        ids = tokenizer.encode(open(__file__).read())  # any real text works as prompt material
    else:  # dummy weights: random token ids
        ids = [rng.randrange(vocab_size) for _ in range(8192)]
    reqs = []
    for _ in range(n):
        plen = rng.randint(16, 256)
        start = rng.randrange(0, len(ids) - plen)
        reqs.append(Request(ids[start:start + plen], rng.randint(min_out, max_out)))
    return reqs


def params(r: Request) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)


def batches(reqs: list[Request], size: int) -> list[list[Request]]:
    return [reqs[i:i + size] for i in range(0, len(reqs), size)]


def static_waste(reqs: list[Request], size: int) -> float:
    """Fraction of decode slot-steps that static batching spends on finished requests."""
    used = sum(r.output_len for r in reqs)
    total = sum(len(b) * max(r.output_len for r in b) for b in batches(reqs, size))
    return 1 - used / total


def run_static(engine: Engine, reqs: list[Request], size: int) -> float:
    t = time.perf_counter()
    for batch in batches(reqs, size):
        engine.generate([r.prompt for r in batch], [params(r) for r in batch])
    return time.perf_counter() - t


def run_continuous(engine: Engine, reqs: list[Request]) -> float:
    t = time.perf_counter()
    engine.generate([r.prompt for r in reqs], [params(r) for r in reqs])
    return time.perf_counter() - t


def run_hf(hf, reqs: list[Request], size: int, pad_id: int) -> float:
    t = time.perf_counter()
    for batch in batches(reqs, size):
        width = max(len(r.prompt) for r in batch)
        ids = torch.tensor([[pad_id] * (width - len(r.prompt)) + r.prompt for r in batch])
        mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch])
        longest = max(r.output_len for r in batch)
        with torch.no_grad():
            hf.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                        do_sample=False, pad_token_id=pad_id)
    return time.perf_counter() - t


def decode_rate(engine: Engine, batch: int, steps: int = 64) -> float:
    """Decode tokens/s with `batch` running sequences (prefill excluded)."""
    p = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    for i in range(batch):
        engine.add_request([1 + i, 2, 3, 4, 5, 6, 7, 8], p)
    engine.step()  # the prefill
    t = time.perf_counter()
    n = 0
    while engine.has_unfinished:
        n += len(engine.step())
    return n / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--min-output", type=int, default=16)
    ap.add_argument("--max-output", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()

    engine = Engine(EngineConfig(model=ModelConfig(source=args.model),
                                 cache=CacheConfig(cpu_kv_cache_gib=2.0),
                                 scheduler=SchedulerConfig(max_num_seqs=args.batch_size)))
    reqs = make_workload(engine.tokenizer, engine.arch.vocab_size, args.num_requests, args.min_output,
                         args.max_output, args.seed)
    useful = sum(r.output_len for r in reqs)
    rows = []
    t_static = run_static(engine, reqs, args.batch_size)
    rows.append(("engine, static batches", t_static))
    t_cont = run_continuous(engine, reqs)
    rows.append(("engine, continuous", t_cont))
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        from pdserve.engine.models.weights import resolve_model

        folder = resolve_model(engine.config.model).folder
        hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=engine.dtype).to(engine.device).eval()
        rows.append(("HF generate, static batches", run_hf(hf, reqs, args.batch_size, engine.arch.eos_token_ids[0])))
    d1 = decode_rate(engine, 1)
    dn = decode_rate(engine, args.batch_size)

    print(f"\nworkload: {len(reqs)} requests, prompts 16-256, outputs {args.min_output}-{args.max_output} "
          f"({useful} tokens), batch {args.batch_size}, {engine.model_name} on {engine.device} ({engine.dtype})")
    print(f"static batching wastes {static_waste(reqs, args.batch_size):.1%} of decode slot-steps on padding\n")
    print(f"| {'system':<28} | {'time s':>8} | {'tok/s':>8} | {'vs HF':>6} |")
    print(f"|{'-' * 30}|{'-' * 10}|{'-' * 10}|{'-' * 8}|")
    hf_time = rows[-1][1] if not args.skip_hf else None
    for name, t in rows:
        ratio = f"{hf_time / t:.2f}x" if hf_time else "-"
        print(f"| {name:<28} | {t:8.1f} | {useful / t:8.1f} | {ratio:>6} |")
    print(f"\ndecode tokens/s: batch 1 {d1:.1f}, batch {args.batch_size} {dn:.1f}")


if __name__ == "__main__":
    main()
