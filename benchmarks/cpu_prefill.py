"""CPU prefill: the engine's time to first token of a fresh prompt against one HF forward.

    python -m benchmarks.cpu_prefill [--lengths 1024 4096] [--runs 3] [--threads N]

The default model (SmolLM2-135M-Instruct), fp32 on the CPU, loaded once into
both. For each prompt length:
- engine: `Engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1))`
  on a fresh prompt of random token ids each run (no prefix-cache hits), with
  the default scheduler (prompts chunked at max_num_batched_tokens=2048: a 4k
  prompt is two steps, the second attending over 4k of context);
- hf: `model(input_ids)`, one transformers forward under torch.inference_mode
  (SDPA attention, logits for every position), on a fresh prompt each run.
Each is run once untimed first (warm-up), then --runs times, the two taking turns
(engine, hf, engine, hf, ...) so that a machine whose speed drifts (other work on
its cores) slows both alike. Prints one table: min and median seconds of each, and
the ratio of the medians (engine / hf).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.engine import Engine
from pdserve.engine.models.weights import resolve_model
from pdserve.engine.sampling import SamplingParams


def fresh_prompt(rng: random.Random, vocab_size: int, length: int) -> list[int]:
    # Avoid the low ids (special tokens); any content works, only the shapes matter.
    return [rng.randrange(100, vocab_size) for _ in range(length)]


def time_engine(engine: Engine, prompt: list[int]) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=1)
    t = time.perf_counter()
    out = engine.generate([prompt], params)
    elapsed = time.perf_counter() - t
    assert len(out[0].token_ids) == 1
    return elapsed


def time_hf(hf, prompt: list[int]) -> float:
    input_ids = torch.tensor([prompt])
    with torch.inference_mode():
        t = time.perf_counter()
        hf(input_ids)
        return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--runs", type=int, default=3, help="timed fresh prompts per length and system")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
    ap.add_argument("--no-hf", action="store_true", help="time the engine only")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    engine = Engine(EngineConfig(model=ModelConfig(device="cpu", dtype="float32")))
    hf = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        folder = resolve_model(ModelConfig()).folder
        hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    vocab = engine.arch.vocab_size
    rng = random.Random(args.seed)

    rows = []
    for length in args.lengths:
        eng: list[float] = []
        ref: list[float] = []
        for run in range(1 + args.runs):  # run 0 is the warm-up
            e = time_engine(engine, fresh_prompt(rng, vocab, length))
            h = time_hf(hf, fresh_prompt(rng, vocab, length)) if hf is not None else None
            if run:
                eng.append(e)
                if h is not None:
                    ref.append(h)
        rows.append((length, eng, ref))

    print(f"CPU prefill, {engine.model_name} fp32, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{args.runs} fresh prompts each (after one warm-up)")
    print(f"{'tokens':>7} | {'engine min':>10} {'median':>8} | {'hf min':>8} {'median':>8} | {'engine/hf':>9}")
    for length, eng, ref in rows:
        e_min, e_med = min(eng), statistics.median(eng)
        if ref:
            h_min, h_med = min(ref), statistics.median(ref)
            print(f"{length:>7} | {e_min:>10.3f} {e_med:>8.3f} | {h_min:>8.3f} {h_med:>8.3f} | {e_med / h_med:>9.2f}")
        else:
            print(f"{length:>7} | {e_min:>10.3f} {e_med:>8.3f} | {'-':>8} {'-':>8} | {'-':>9}")


if __name__ == "__main__":
    main()
