"""The OpenAI HTTP API's overhead against gRPC on the same server, in one run.

    python -m benchmarks.http_overhead [--concurrency 1,64] [--rounds 2] [--prompt-len 32] [--output-len 16]

One in-process server (one colocated worker, or with `--mode disaggregated` a prefill +
decode pair; CPU and the default model where there is no GPU) answers the same requests (random token
ids, EOS ignored, greedy) through gRPC (`pdserve bench`'s gRPC backend) and through
`/v1/completions` streamed as server-sent events (its OpenAI backend), at each
concurrency: all requests sent at once, at most that many in flight. The two APIs take
turns, in alternating order, `--rounds` times, so drift in the machine's load hits both.
Prints one table: TTFT, TPOT, ITL and output throughput per API and concurrency, and
HTTP / gRPC ratios (the goal: TTFT within 10%, throughput no lower).
"""

from __future__ import annotations

import argparse
import asyncio
import os

import numpy as np

from pdserve.cluster.bench.backends import Backend, GrpcBackend, OpenAIBackend, RequestResult
from pdserve.cluster.bench.dataset import random_requests
from pdserve.cluster.bench.runner import LoadShape, run_load
from pdserve.cluster.server import start_server
from pdserve.cluster.settings.config import config_from_dict

APIS = ("grpc", "http")


def _p50_ms(xs: list[float]) -> float:
    return float(np.median(xs)) * 1000 if xs else float("nan")


async def _measure(backend: Backend, concurrency: int, num_requests: int, args: argparse.Namespace,
                   vocab: int, seed: int) -> tuple[list[RequestResult], float]:
    requests = random_requests(num_requests, args.prompt_len, args.output_len, vocab, seed=seed)
    run = await run_load(backend, requests, LoadShape(max_concurrency=concurrency), progress=False)
    return run.results, run.duration_s


async def main_async(args: argparse.Namespace) -> None:
    import ray

    config = config_from_dict({"server": {"port": 0, "http_port": 0, "metrics_port": 0},
                               "admission": {"max_waiting_per_worker": 1024}, "pools": {"mode": args.mode}})
    server = await start_server(config)
    backends: dict[str, Backend] = {
        "grpc": GrpcBackend(f"127.0.0.1:{server.port}", temperature=0.0),
        "http": OpenAIBackend(f"http://127.0.0.1:{server.http_port}", temperature=0.0),
    }
    rows = []
    try:
        vocab = await backends["grpc"].vocab_size()
        for api in APIS:  # warm up both paths (first-request costs: connections, the model's first steps)
            await _measure(backends[api], 2, 2, args, vocab, seed=99)
        for concurrency in args.concurrency:
            num_requests = max(concurrency, args.min_requests)
            results: dict[str, list[RequestResult]] = {api: [] for api in APIS}
            tokens: dict[str, int] = dict.fromkeys(APIS, 0)
            seconds: dict[str, float] = dict.fromkeys(APIS, 0.0)
            for r in range(args.rounds):
                for api in (APIS if r % 2 == 0 else APIS[::-1]):
                    got, duration = await _measure(backends[api], concurrency, num_requests, args, vocab, seed=r)
                    results[api] += got
                    tokens[api] += sum(x.output_tokens for x in got if x.ok)
                    seconds[api] += duration
                    errors = sorted({x.error for x in got if x.error})
                    print(f"concurrency {concurrency}, round {r}, {api}: {duration:.1f} s, "
                          f"{sum(not x.ok for x in got)} failed {errors[:2]}", flush=True)
            for api in APIS:
                ok = [x for x in results[api] if x.ok]
                rows.append((api, concurrency, len(results[api]) - len(ok), _p50_ms([x.ttft for x in ok]),
                             float(np.percentile([x.ttft for x in ok], 90)) * 1000 if ok else float("nan"),
                             _p50_ms([x.tpot for x in ok if x.tpot is not None]),
                             _p50_ms([g for x in ok for g in x.itls]), tokens[api] / seconds[api]))
    finally:
        for backend in backends.values():
            await backend.close()
        await server.stop()
        ray.shutdown()
    print(f"\n{args.mode}, prompts {args.prompt_len} tokens, outputs {args.output_len} tokens, {args.rounds} rounds, "
          f"load average {os.getloadavg()[0]:.1f} at the end")
    print("| API | concurrency | requests failed | TTFT p50 ms | TTFT p90 ms | TPOT p50 ms | ITL p50 ms "
          "| output tok/s | TTFT vs gRPC | tok/s vs gRPC |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    by_key = {(api, c): row for api, c, *row in rows}
    for api, concurrency, failed, ttft, ttft90, tpot, itl, tput in rows:
        base = by_key[("grpc", concurrency)]
        print(f"| {api} | {concurrency} | {failed} | {ttft:.1f} | {ttft90:.1f} | {tpot:.1f} | {itl:.1f} | "
              f"{tput:.1f} | {ttft / base[1]:.2f} | {tput / base[5]:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,64", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--mode", default="colocated", choices=["colocated", "disaggregated"],
                    help="colocated (default): the frontends compared without the KV transfers' own variance")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--min-requests", type=int, default=8, help="requests per round at least (concurrency 1: 8)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=16)
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
