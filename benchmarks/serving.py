"""TTFT and ITL of pdserve, disaggregated vs colocated, and the ITL of running streams
while a burst of long prompts arrives (the claim disaggregation exists for).

    python -m benchmarks.serving --model dummy:llama-3.1-8b [--rates 2,8] [--num-requests 48]

Disaggregated: one prefill worker and one decode worker (one GPU each on a
two-GPU machine, KV over UCX; `--gpus-per-worker 0.5` puts both on one GPU, to time the
control plane on real kernels). Colocated: one mixed worker on one GPU. After each rate,
the server's own breakdown of a first token's time by hop (pdserve_first_token_hop_seconds,
mean ms; the hops add up to the server's TTFT). Each mode
runs in this process against a real server through real gRPC streams, sent by `pdserve
bench`'s gRPC backend and load generator (pdserve.cluster.bench). Prints one table.
"""

from __future__ import annotations

import argparse
import asyncio

from pdserve.cluster.bench.backends import GrpcBackend, RequestResult
from pdserve.cluster.bench.dataset import random_requests
from pdserve.cluster.bench.report import summarize
from pdserve.cluster.bench.runner import LoadShape, RunResult, run_load
from pdserve.cluster.server import start_server
from pdserve.cluster.serving.metrics import Metrics
from pdserve.cluster.settings.config import config_from_dict


def _ms(xs: list[float], q: float) -> float:
    """The q-quantile of seconds `xs`, in ms (nan when empty)."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000


def _row(name: str, results: list[RequestResult], itls: list[float] | None = None) -> tuple:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok]
    tt2t = [r.chunk_times[1] - r.start for r in ok if len(r.chunk_times) > 1]  # disaggregated: decode's first
    gaps = itls if itls is not None else [g for r in ok for g in r.itls]
    return (name, _ms(ttft, .5), _ms(ttft, .99), _ms(tt2t, .5), _ms(gaps, .5), _ms(gaps, .99),
            max(gaps, default=float("nan")) * 1000, len(results) - len(ok))


async def load_run(backend: GrpcBackend, rate: float, n: int, prompt_len: int, output_len: int,
                   vocab: int) -> RunResult:
    requests = random_requests(n, prompt_len, output_len, vocab, seed=0)
    return await run_load(backend, requests, LoadShape(request_rate=rate), progress=False)


async def burst_run(backend: GrpcBackend, vocab: int, burst_len: int, burst_count: int) -> list[float]:
    """16 streams decode; 2 s in, `burst_count` prompts of `burst_len` tokens arrive at once.
    Returns the running streams' token gaps that ended during the burst."""
    background = [asyncio.create_task(backend.send(r, 600))
                  for r in random_requests(16, 128, 400, vocab, seed=1)]
    await asyncio.sleep(2.0)
    burst = await run_load(backend, random_requests(burst_count, burst_len, 2, vocab, seed=2), LoadShape(),
                           progress=False)
    window = (burst.results[0].start, burst.results[0].start + burst.duration_s)
    return [b - a for r in await asyncio.gather(*background)
            for a, b in zip(r.chunk_times, r.chunk_times[1:]) if window[0] <= b <= window[1]]


async def run_mode(mode: str, args: argparse.Namespace) -> list[tuple]:
    config = config_from_dict({
        "engine": {"model": {"source": args.model},
                   # Workers sharing a GPU: each sizes its KV from the memory free when it starts (all
                   # of it, for the first), so their pools are sized here instead.
                   "cache": {"num_blocks": args.num_blocks} if args.num_blocks else {},
                   "scheduler": {"max_num_batched_tokens": args.token_budget}},
        "server": {"port": 0, "metrics_port": 0, "http": False},
        "admission": {"max_waiting_per_worker": 1024},
        "pools": {"mode": mode, "num_prefill": 1, "num_decode": 1,
                  **({"gpus_per_worker": args.gpus_per_worker} if args.gpus_per_worker else {})},
    })
    server = await start_server(config)
    rows = []
    backend = GrpcBackend(f"127.0.0.1:{server.port}", temperature=0.0)
    try:
        vocab = await backend.vocab_size()
        # Warm up at the measured prompt length: Triton compiles a prefill kernel per tile
        # shape, and a compile inside a timed run shows up as a seconds-long TTFT tail.
        await load_run(backend, 4.0, 4, args.prompt_len, 8, vocab)
        for rate in args.rates:
            before = hop_sums(server.metrics)
            run = await load_run(backend, rate, args.num_requests, args.prompt_len, args.output_len, vocab)
            rows.append(_row(f"{mode}, {rate:g} req/s", run.results))
            summary = summarize(run)
            print(f"{mode}, {rate:g} req/s: {summary['output_throughput']:.0f} output tok/s, "
                  f"TPOT p50 {summary['median_tpot_ms']:.1f} ms")
            print(f"{mode}, {rate:g} req/s, first token by hop (server, mean ms): "
                  + ", ".join(f"{hop} {ms:.2f}" for hop, ms in hop_means(before, hop_sums(server.metrics)).items()))
        if args.burst_count:
            gaps = await burst_run(backend, vocab, args.burst_len, args.burst_count)
            rows.append(_row(f"{mode}, ITL during {args.burst_count}x{args.burst_len} burst", [], gaps))
        print_kv_transfers(mode, server.metrics)
    finally:
        await backend.close()
        await server.stop()
    return rows


def hop_sums(metrics: Metrics) -> dict[str, tuple[float, float]]:
    """hop -> (sum of seconds, count) of the server's first-token hops so far (TTFT as "ttft")."""
    out: dict[str, list[float]] = {}
    for family in metrics.registry.collect():
        if family.name in ("pdserve_first_token_hop_seconds", "pdserve_time_to_first_token_seconds"):
            for s in family.samples:
                hop = s.labels.get("hop", "ttft")
                if s.name.endswith("_sum"):
                    out.setdefault(hop, [0.0, 0.0])[0] = s.value
                elif s.name.endswith("_count"):
                    out.setdefault(hop, [0.0, 0.0])[1] = s.value
    return {hop: (total, n) for hop, (total, n) in out.items()}


def hop_means(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Mean ms per hop over the observations between `before` and `after`."""
    means = {}
    for hop, (total, n) in after.items():
        total0, n0 = before.get(hop, (0.0, 0.0))
        if n > n0:
            means[hop] = (total - total0) / (n - n0) * 1000
    return means


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
    for name, *figures, errors in rows:
        print(f"| {name:<44} | " + " | ".join(f"{f:{9 if i < 3 else 8}.1f}" for i, f in enumerate(figures))
              + f" | {errors:3d} |")
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
    ap.add_argument("--num-blocks", type=int, default=None,
                    help="KV blocks per worker (needed when workers share a GPU)")
    ap.add_argument("--gpus-per-worker", type=float, default=None,
                    help="GPUs per worker (0.5: a prefill and a decode worker share one GPU)")
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
