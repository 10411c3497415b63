"""TTFT and ITL of pdserve, disaggregated vs colocated, and the ITL of running streams
while a burst of long prompts arrives (the claim disaggregation exists for).

    python -m benchmarks.serving --model dummy:llama-3.1-8b [--rates 2,8] [--num-requests 48]

Disaggregated: one prefill worker and one decode worker (one GPU each on a
two-GPU machine, KV over UCX). Colocated: one mixed worker on one GPU. Each mode
runs in this process against a real server through real gRPC streams. Prints one table.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import dataclass, field

import grpc

from pdserve.cluster.config import config_from_dict
from pdserve.cluster.metrics import Metrics
from pdserve.cluster.server import start_server
from pdserve.proto.v1 import generation_pb2 as pb
from pdserve.proto.v1 import generation_pb2_grpc as pb_grpc


@dataclass
class Trace:
    ttft: list[float] = field(default_factory=list)
    tt2t: list[float] = field(default_factory=list)  # to the second token (disaggregated: the decode side's first)
    itl: list[float] = field(default_factory=list)
    itl_windows: list[tuple[float, float]] = field(default_factory=list)  # (time, gap) for burst analysis
    errors: int = 0


async def stream(stub, ids: list[int], max_tokens: int, trace: Trace, t0: float) -> None:
    req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids),
                             sampling=pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    start = time.perf_counter()
    last, count = start, 0
    try:
        async for _ in stub.Generate(req, timeout=600):
            now = time.perf_counter()
            count += 1
            if count == 1:
                trace.ttft.append(now - start)
            else:
                if count == 2:
                    trace.tt2t.append(now - start)
                trace.itl.append(now - last)
                trace.itl_windows.append((now - t0, now - last))
            last = now
    except grpc.aio.AioRpcError:
        trace.errors += 1


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000


async def load_run(stub, rate: float, n: int, prompt_len: int, output_len: int, vocab: int) -> Trace:
    rng = random.Random(0)
    trace = Trace()
    t0 = time.perf_counter()
    tasks = []
    for _ in range(n):
        ids = [rng.randrange(vocab) for _ in range(prompt_len)]
        tasks.append(asyncio.create_task(stream(stub, ids, output_len, trace, t0)))
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)
    return trace


async def burst_run(stub, vocab: int, burst_len: int, burst_count: int) -> tuple[Trace, float, float]:
    """16 streams decode; 2 s in, `burst_count` prompts of `burst_len` tokens arrive at once."""
    rng = random.Random(1)
    trace, burst = Trace(), Trace()
    t0 = time.perf_counter()
    background = [asyncio.create_task(stream(stub, [rng.randrange(vocab) for _ in range(128)], 400, trace, t0))
                  for _ in range(16)]
    await asyncio.sleep(2.0)
    burst_start = time.perf_counter() - t0
    prompts = [[rng.randrange(vocab) for _ in range(burst_len)] for _ in range(burst_count)]
    await asyncio.gather(*(stream(stub, p, 2, burst, t0) for p in prompts))
    burst_end = time.perf_counter() - t0
    await asyncio.gather(*background)
    during = Trace(itl=[gap for t, gap in trace.itl_windows if burst_start <= t <= burst_end])
    return during, burst_start, burst_end


async def run_mode(mode: str, args: argparse.Namespace) -> list[tuple[str, Trace]]:
    config = config_from_dict({
        "engine": {"model": {"source": args.model},
                   "scheduler": {"max_num_batched_tokens": args.token_budget}},
        "server": {"port": 0, "metrics_port": 0},
        "admission": {"max_waiting_per_worker": 1024},
        "pools": {"mode": mode, "num_prefill": 1, "num_decode": 1},
    })
    server = await start_server(config)
    results = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.GenerationStub(channel)
            models = await stub.ListModels(pb.ListModelsRequest())
            vocab = models.models[0].vocab_size
            # Warm up at the measured prompt length: Triton compiles a prefill kernel per tile
            # shape, and a compile inside a timed run shows up as a seconds-long TTFT tail.
            await load_run(stub, 4.0, 4, args.prompt_len, 8, vocab)
            for rate in args.rates:
                trace = await load_run(stub, rate, args.num_requests, args.prompt_len, args.output_len, vocab)
                results.append((f"{mode}, {rate:g} req/s", trace))
            during, *_ = await burst_run(stub, vocab, args.burst_len, args.burst_count)
            results.append((f"{mode}, ITL during {args.burst_count}x{args.burst_len} burst", during))
        print_kv_transfers(mode, server.metrics)
    finally:
        await server.stop()
    return results


def print_kv_transfers(mode: str, metrics: Metrics) -> None:
    """KV transfers of the run by transport and path (direct writes or UCX messages)."""
    for family in metrics.registry.collect():
        if family.name != "pdserve_kv_transfer_seconds":
            continue
        sums = {tuple(s.labels.values()): s.value for s in family.samples if s.name.endswith("_sum")}
        for s in family.samples:
            if s.name.endswith("_count") and s.value:
                labels = tuple(s.labels.values())
                print(f"{mode}: {int(s.value)} KV transfers, {', '.join(labels)}, "
                      f"mean {sums[labels] / s.value * 1e3:.2f} ms (prefill side)")


async def main_async(args: argparse.Namespace) -> None:
    import ray

    rows = []
    for mode in args.modes:
        rows += await run_mode(mode, args)
    ray.shutdown()
    print(f"\nmodel {args.model}, prompts {args.prompt_len}, outputs {args.output_len}, "
          f"token budget {args.token_budget}")
    print(f"| {'run':<44} | {'TTFT p50':>9} | {'TTFT p99':>9} | {'TT2T p50':>9} | {'ITL p50':>8} | "
          f"{'ITL p99':>8} | {'ITL max':>8} | err |")
    print(f"|{'-' * 46}|{'-' * 11}|{'-' * 11}|{'-' * 11}|{'-' * 10}|{'-' * 10}|{'-' * 10}|-----|")
    for name, t in rows:
        print(f"| {name:<44} | {pct(t.ttft, .5):9.1f} | {pct(t.ttft, .99):9.1f} | {pct(t.tt2t, .5):9.1f} | "
              f"{pct(t.itl, .5):8.1f} | {pct(t.itl, .99):8.1f} | {max(t.itl, default=float('nan')) * 1000:8.1f} | "
              f"{t.errors:3d} |")
    print("(milliseconds)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--modes", default="disaggregated,colocated", type=lambda s: s.split(","))
    ap.add_argument("--rates", default="2,8", type=lambda s: [float(x) for x in s.split(",")])
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--burst-len", type=int, default=8192)
    ap.add_argument("--burst-count", type=int, default=8)
    ap.add_argument("--token-budget", type=int, default=2048)
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
