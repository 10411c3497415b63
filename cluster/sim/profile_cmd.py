"""`pdserve profile`: measure an engine's step costs and write the simulator's profile.

It times, on the engine a worker runs (same config flags as `pdserve generate`), one prompt
alone at several lengths (prefill against prompt length) and decode steps at several batch
sizes, at two contexts (decode step against batch and context). The KV transfer is not timed
here (it needs two workers): its bytes per token come from the engine's KV layout, its
bandwidth and latency from the flags (`benchmarks/transport.py` measures them).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from pdserve.cluster.settings.flags import engine_config_from_args
from pdserve.cluster.sim.step_costs import Curve, StepCosts
from pdserve.engine.engine import Engine
from pdserve.engine.sampling import SamplingParams


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `profile` on the `pdserve` subcommand parsers."""
    from pdserve.cluster.settings.config_tree import config_fields
    from pdserve.cluster.settings.flags import add_config_flags
    from pdserve.engine.config import EngineConfig

    p = subparsers.add_parser("profile", help="measure an engine's prefill and decode step costs and write the "
                                              "simulator's profile (JSON)", description=__doc__,
                              usage="%(prog)s [options] [--engine.<section>.<field> VALUE ...] OUT")
    p.add_argument("out", help="the profile file to write")
    p.add_argument("--prompt-lengths", type=_ints, default=(32, 128, 512), help="comma-separated prompt lengths")
    p.add_argument("--batch-sizes", type=_ints, default=(1, 4, 16), help="comma-separated decode batch sizes")
    p.add_argument("--contexts", type=_ints, default=(32, 256),
                   help="two comma-separated contexts (tokens per sequence) the decode steps run at")
    p.add_argument("--steps", type=int, default=8, help="decode steps timed per batch size")
    p.add_argument("--repeats", type=int, default=3, help="runs of each measurement; the least is kept")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads while measuring: what a worker gets (Ray gives an actor of num_cpus=1 "
                        "one OpenMP thread); more threads than free cores make every step several times slower")
    p.add_argument("--kv-bytes-per-s", type=float, default=1e9, help="KV transfer bandwidth between workers")
    p.add_argument("--kv-latency-s", type=float, default=0.002, help="a KV transfer's fixed cost")
    add_config_flags(p, config_fields(EngineConfig, "engine."))
    p.set_defaults(func=cmd_profile)
    return p


def cmd_profile(args: argparse.Namespace) -> int:
    if len(args.contexts) != 2 or args.contexts[0] >= args.contexts[1]:
        raise ValueError(f"--contexts takes two increasing lengths, got {args.contexts}")
    torch.set_num_threads(args.threads)
    engine = Engine(engine_config_from_args(args))
    try:
        costs = measure(engine, args.prompt_lengths, args.batch_sizes, args.contexts, args.steps, args.repeats)
    finally:
        engine.close()
    layout = engine.kv_wire_layout
    costs = StepCosts(costs.prefill, costs.decode, costs.decode_context_tokens, costs.decode_s_per_context_token,
                      layout.bytes_per_block / layout.block_size, args.kv_latency_s, args.kv_bytes_per_s,
                      engine.config.scheduler.max_num_seqs, engine.config.scheduler.max_num_batched_tokens,
                      f"pdserve profile, model {engine.config.model.source}, device {engine.config.model.device}")
    costs.save(args.out)
    print(f"wrote {args.out}: prefill {list(zip(costs.prefill.xs, costs.prefill.ys))}, "
          f"decode {list(zip(costs.decode.xs, costs.decode.ys))}, "
          f"{costs.decode_s_per_context_token:.3g} s per context token")
    return 0


def measure(engine: Engine, prompt_lengths: tuple[int, ...], batch_sizes: tuple[int, ...],
            contexts: tuple[int, int], steps: int, repeats: int = 3) -> StepCosts:
    """Prefill and decode curves of `engine` (KV figures left at their defaults)."""
    _run(engine, [_prompt(16, 0)], 2)  # warm-up: first calls allocate and compile
    # The least of `repeats` runs: the first at a new shape may pay one-time costs (allocation),
    # and on a shared machine the others' load comes and goes; the least is the engine's own.
    prefill = [(n, min(_run(engine, [_prompt(n, n + salt)], 1) for salt in range(repeats))) for n in prompt_lengths]
    low, high = contexts
    decode = [(b, min(_decode_step_s(engine, b, low, steps, salt) for salt in range(repeats))) for b in batch_sizes]
    b = max(batch_sizes)
    at_high = min(_decode_step_s(engine, b, high, steps, salt) for salt in range(repeats))
    per_token = (at_high - dict(decode)[b]) / (b * (high - low))
    return StepCosts(Curve.of(prefill), Curve.of(decode), low, max(0.0, per_token))


def _prompt(n: int, salt: int) -> list[int]:
    """n token ids no other prompt starts with (no prefix-cache hit between measurements)."""
    return [100 + (salt * 7919 + i * 31) % 20000 for i in range(n)]


def _run(engine: Engine, prompts: list[list[int]], max_tokens: int) -> float:
    """Seconds to run `prompts` to `max_tokens` each."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    for p in prompts:
        engine.add_request(p, params)
    while engine.has_unfinished:
        engine.step()
    return time.perf_counter() - start


def _decode_step_s(engine: Engine, batch: int, context: int, steps: int, salt: int) -> float:
    """One decode step of `batch` sequences near `context` tokens: the mean of `steps` steps
    timed once every sequence has its first token (its prompt done)."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    prompts = [_prompt(context, 1000 + salt * 100_000 + context * 64 + i) for i in range(batch)]
    rids = {engine.add_request(p, params) for p in prompts}
    started: set[str] = set()
    while started != rids and engine.has_unfinished:
        started.update(d.request_id for d in engine.step() if d.token_ids)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = (time.perf_counter() - start) / steps
    while engine.has_unfinished:
        engine.step()
    return elapsed
