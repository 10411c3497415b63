"""Penalties and logit bias (issue 38): the decode step with them on every row against without.

    python -m benchmarks.penalties [--device cpu] [--batches 1 64] [--runs 7] [--steps 4]

The default model (SmolLM2-135M-Instruct), fp32. Two engines, loaded alike: one runs B
requests without penalties, the other the same B requests with presence 0.5, frequency 0.5,
repetition 1.1 and a 16-token logit_bias on every row (sampled at temperature 0.8 both, so
that the sampler's work is the same). Each gets its prompts (128 random token ids) prefilled
and a first decode step untimed; then each run times --steps decode steps of one engine, then
of the other, the order swapped every run (paired and alternated: a machine whose speed
drifts slows both alike). Prints the median seconds per step of each over --runs runs, and
the ratio. Target (issue 38): at most 3% more with penalties.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sampling import SamplingParams

PROMPT_LEN = 128


def params_for(penalized: bool, vocab_size: int, seed: int) -> SamplingParams:
    plain = SamplingParams(temperature=0.8, max_tokens=4096, ignore_eos=True)
    if not penalized:
        return plain
    rng = random.Random(seed)
    bias = {rng.randrange(100, vocab_size): rng.uniform(-5, 5) for _ in range(16)}
    return SamplingParams(temperature=0.8, max_tokens=4096, ignore_eos=True, presence_penalty=0.5,
                          frequency_penalty=0.5, repetition_penalty=1.1, logit_bias=bias)


def start(engine: Engine, prompts: list[list[int]], penalized: bool) -> None:
    """Queue the requests and step until every one decodes (its prompt done, a first decode step run)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params_for(penalized, engine.arch.vocab_size, i))
    while any(seq.num_output_tokens < 2 for seq in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()


def time_steps(engine: Engine, steps: int) -> float:
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - t) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--runs", type=int, default=7, help="timed runs per batch and engine (the median is taken)")
    ap.add_argument("--steps", type=int, default=4, help="decode steps per timed run")
    args = ap.parse_args()
    config = EngineConfig(model=ModelConfig(device=args.device, dtype="float32"), cache=CacheConfig(cpu_kv_cache_gib=1))
    engines = {False: Engine(config), True: Engine(config)}
    vocab = engines[False].arch.vocab_size
    rng = random.Random(0)
    print(f"device {args.device}, torch threads {torch.get_num_threads()}, {args.runs} runs x {args.steps} steps")
    print(f"{'batch':>5} {'plain s/step':>13} {'penalized s/step':>17} {'ratio':>7}")
    for batch in args.batches:
        prompts = [[rng.randrange(100, vocab) for _ in range(PROMPT_LEN)] for _ in range(batch)]
        for penalized, engine in engines.items():
            start(engine, prompts, penalized)
        times: dict[bool, list[float]] = {False: [], True: []}
        for run in range(args.runs):
            for penalized in ((False, True) if run % 2 == 0 else (True, False)):
                times[penalized].append(time_steps(engines[penalized], args.steps))
        for engine in engines.values():
            for seq in list(engine.scheduler.running):
                engine.abort(seq.request_id)
            while engine.has_unfinished:
                engine.step()
        plain, penalized = statistics.median(times[False]), statistics.median(times[True])
        print(f"{batch:>5} {plain:>13.4f} {penalized:>17.4f} {penalized / plain:>7.3f}")


if __name__ == "__main__":
    main()
