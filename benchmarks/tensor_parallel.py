"""Tensor parallelism: each size against one rank in the same run, plus KV moved between
pools of different sizes against a plain copy of the same bytes.

    python -m benchmarks.tensor_parallel [--model dummy:llama-3.1-8b] [--sizes 1 2] [--device cuda]
        [--prompt-len 1024] [--new-tokens 256] [--offline-requests 64] [--offline-len 1024]

Per tensor-parallel size (an Engine of that size; on CUDA one GPU per rank, on the CPU one
process per rank, gloo):
- decode: one stream, a `--prompt-len` prompt of random ids, greedy, `--new-tokens`
  tokens; tokens/s after the first, and per GPU.
- offline: `--offline-requests` requests of `--offline-len` random ids in and out
  (ignore_eos, temperature 1) through `Engine.generate`: output tokens/s, and per GPU.
- all-reduce share: torch.profiler over 8 decode steps of 8 sequences on rank 0: the
  share of the steps' wall time inside the collectives (gloo/NCCL all-reduce and the
  logits' all-gather), from the profiler's own events.
Then KV moves (kv_transport.shards.PoolShards) of 64 blocks of the model's layout from a
worker of size a to one of size b, for each pair of `--sizes`: gather + scatter, against a
`copy_` of the same bytes on rank 0's device.
Limits: decode's weight-read bound per size (weights / size / 4.3 TB/s on an H200).
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pdserve.engine.engine import Engine
from pdserve.engine.models.arch import DUMMY_SHAPES
from pdserve.engine.models.parallel import ShardPlan
from pdserve.engine.models.registry import param_counts
from pdserve.engine.sampling import SamplingParams
from pdserve.kv_transport.shards import PoolShards

COPY_BW = 4.3e12  # bytes/s, the H200's measured device copy


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _ids(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(10, vocab - 10) for _ in range(n)]


def decode_rate(engine: Engine, vocab: int, prompt_len: int, new_tokens: int) -> float:
    rng = random.Random(1)
    engine.add_request(_ids(rng, vocab, prompt_len), SamplingParams(temperature=0.0, max_tokens=new_tokens,
                                                                    ignore_eos=True))
    first, count = None, 0
    while engine.has_unfinished:
        for delta in engine.step():
            count += len(delta.token_ids)
            if first is None:
                first, count = time.perf_counter(), 0
    return count / (time.perf_counter() - first) if first is not None and count else 0.0


def offline_rate(engine: Engine, vocab: int, num: int, length: int) -> float:
    rng = random.Random(2)
    prompts = [_ids(rng, vocab, length) for _ in range(num)]
    params = SamplingParams(temperature=1.0, max_tokens=length, ignore_eos=True, seed=0)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def collective_share(engine: Engine, vocab: int, device: str) -> float:
    """Share of 8 decode steps' wall time rank 0 spends in collectives (profiler events)."""
    from torch.profiler import ProfilerActivity, profile

    rng = random.Random(3)
    for _ in range(8):
        engine.add_request(_ids(rng, vocab, 64), SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    for _ in range(4):  # past the prefill
        engine.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(8):
            engine.step()
        _sync(device)
        wall_us = (time.perf_counter() - start) * 1e6
    while engine.has_unfinished:
        engine.step()
    names = ("allreduce", "all_reduce", "allgather", "all_gather")
    on_gpu = device.startswith("cuda")
    spent = sum((e.device_time_total if on_gpu else e.cpu_time_total) for e in prof.key_averages()
                if any(n in e.key.lower() for n in names) and not e.key.startswith("ProfilerStep"))
    return min(1.0, spent / wall_us)


def kv_move_ms(model: str, src_tp: int, dst_tp: int, device: str, num_blocks: int = 64) -> tuple[float, float]:
    """(PoolShards gather + scatter, copy_ of the same bytes), ms, best of 5."""
    arch = DUMMY_SHAPES[model.removeprefix("dummy:")]
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32

    def worker(tp: int) -> PoolShards:
        shards = []
        for rank in range(tp):
            plan = ShardPlan.of(arch, rank, tp)
            dev = torch.device("cuda", rank) if device.startswith("cuda") else torch.device("cpu")
            kv = torch.zeros(arch.num_layers, 2, 2 * num_blocks, 16, plan.num_kv_heads, arch.head_dim, dtype=dtype,
                             device=dev)
            shards.append((kv, plan.kv_head_start))
        return PoolShards(shards, arch.num_kv_heads)

    src, dst = worker(src_tp), worker(dst_tp)
    ids = torch.arange(0, 2 * num_blocks, 2)
    plain = torch.empty(num_blocks * src.bytes_per_block, dtype=torch.uint8, device=src.device)
    other = torch.empty_like(plain)

    def best(fn) -> float:
        times = []
        for _ in range(5):
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            times.append((time.perf_counter() - start) * 1e3)
        return min(times)

    return best(lambda: dst.scatter(ids, src.gather(ids))), best(lambda: other.copy_(plain))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--offline-requests", type=int, default=64)
    ap.add_argument("--offline-len", type=int, default=1024)
    args = ap.parse_args()
    arch = DUMMY_SHAPES[args.model.removeprefix("dummy:")]
    weight_bytes = param_counts(arch).total * (2 if args.device.startswith("cuda") else 4)
    rows = []
    for size in args.sizes:
        config = EngineConfig(model=ModelConfig(source=args.model, device=args.device),
                              cache=CacheConfig(cpu_kv_cache_gib=0.5),
                              scheduler=SchedulerConfig(max_num_seqs=max(8, args.offline_requests)),
                              parallel=ParallelConfig(tensor_parallel_size=size))
        engine = Engine(config)
        try:
            decode = decode_rate(engine, arch.vocab_size, args.prompt_len, args.new_tokens)
            offline = offline_rate(engine, arch.vocab_size, args.offline_requests, args.offline_len)
            share = collective_share(engine, arch.vocab_size, args.device) if size > 1 else 0.0
        finally:
            engine.close()
        rows.append((size, decode, offline, share))
    base_decode, base_offline = rows[0][1], rows[0][2]
    print(f"{args.model} on {args.device}, prompt {args.prompt_len}, {args.new_tokens} new tokens; offline "
          f"{args.offline_requests} x {args.offline_len}/{args.offline_len}; baseline: TP {rows[0][0]}, same run")
    print("| TP | decode tok/s | vs base | limit tok/s | offline tok/s | per GPU vs base | collectives share |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for size, decode, offline, share in rows:
        limit = COPY_BW * size / weight_bytes if args.device.startswith("cuda") else float("nan")
        print(f"| {size} | {decode:.1f} | {decode / base_decode:.2f} | {limit:.0f} | {offline:.0f} | "
              f"{offline / size / (base_offline / rows[0][0]):.2f} | {share:.1%} |")
    print("\n| KV from TP a to TP b (64 blocks) | gather + scatter ms | copy of the same bytes ms | ratio |")
    print("|---|---:|---:|---:|")
    for a in args.sizes:
        for b in args.sizes:
            moved, copied = kv_move_ms(args.model, a, b, args.device)
            print(f"| {a} -> {b} | {moved:.3f} | {copied:.3f} | {moved / copied:.2f} |")


if __name__ == "__main__":
    main()
