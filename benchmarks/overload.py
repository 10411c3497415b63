"""Overload: what a burst beyond the server's capacity costs the requests it admitted.

    python -m benchmarks.overload [--seats 4] [--max-waiting 4] [--burst 64] [--output-len 64]

One in-process server (disaggregated: a prefill and a decode worker; CPU and the default
model where there is no GPU) with `--seats` running seats and a queue of `--max-waiting`
per decode worker. Two phases, the same `--seats` streams (random token ids, greedy, EOS
ignored) in each: alone (the baseline), then with a burst of `--burst` more requests sent
at once while they stream. The queue takes `--max-waiting` of the burst; the rest must be
refused at once with RESOURCE_EXHAUSTED. Prints the admitted streams' ITL in both phases
and how long each refusal took (send to error, as the client saw it). The issue's goals:
refusals in under 50 ms, admitted streams' ITL unchanged.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import numpy as np

from pdserve.cluster.bench.backends import GrpcBackend, RequestResult
from pdserve.cluster.bench.dataset import random_requests
from pdserve.cluster.server import start_server
from pdserve.cluster.settings.config import config_from_dict


def _ms(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) * 1000 if xs else float("nan")


async def _timed(backend: GrpcBackend, request, timeout_s: float) -> tuple[RequestResult, float]:
    start = time.perf_counter()
    result = await backend.send(request, timeout_s)
    return result, time.perf_counter() - start


async def main_async(args: argparse.Namespace) -> None:
    import ray

    config = config_from_dict({"server": {"port": 0, "http": False, "metrics_port": 0},
                               "admission": {"max_waiting_per_worker": args.max_waiting},
                               "engine": {"scheduler": {"max_num_seqs": args.seats}}})
    server = await start_server(config)
    backend = GrpcBackend(f"127.0.0.1:{server.port}", temperature=0.0)
    rows = []
    try:
        vocab = await backend.vocab_size()
        await _timed(backend, random_requests(1, args.prompt_len, 4, vocab, seed=99)[0], 600)  # warm up
        for phase in ("alone", "with a burst"):
            streams = random_requests(args.seats, args.prompt_len, args.output_len, vocab, seed=1)
            running = [asyncio.create_task(_timed(backend, r, 600)) for r in streams]
            burst: list[tuple[RequestResult, float]] = []
            if phase == "with a burst":
                # Once every admitted stream holds its seat (and a moment more: they stream), the burst.
                deadline = time.monotonic() + 600
                while server.worker_set.num_queued() or server.worker_set.summary("decode").num_inflight < args.seats:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"the {args.seats} streams did not all take a seat within 600 s")
                    await asyncio.sleep(0.01)
                await asyncio.sleep(args.burst_after_s)
                extra = random_requests(args.burst, args.prompt_len, args.output_len, vocab, seed=2)
                burst = await asyncio.gather(*(_timed(backend, r, 600) for r in extra))
            admitted = await asyncio.gather(*running)
            itls = [g for result, _ in admitted if result.ok for g in result.itls]
            refused = [s for result, s in burst if result.error and "RESOURCE_EXHAUSTED" in result.error]
            served = [s for result, s in burst if result.ok]
            other = [r.error for r, _ in burst if not r.ok and not (r.error and "RESOURCE_EXHAUSTED" in r.error)]
            rows.append((phase, sum(r.ok for r, _ in admitted), _ms(itls, 50), _ms(itls, 99), len(served),
                         len(refused), _ms(refused, 50), _ms(refused, 99), max(refused, default=float("nan")) * 1000,
                         sorted({str(e) for e in other})[:2]))
    finally:
        await backend.close()
        await server.stop()
        ray.shutdown()
    print(f"\n{args.seats} seats, queue {args.max_waiting}, burst {args.burst}, prompts {args.prompt_len} tokens, "
          f"outputs {args.output_len}; load average {os.getloadavg()[0]:.1f} at the end")
    print("| phase | admitted streams ok | their ITL p50 ms | ITL p99 ms | burst served | burst refused "
          "| refusal p50 ms | refusal p99 ms | refusal max ms | other errors |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for phase, ok, p50, p99, served, refused, r50, r99, rmax, other in rows:
        print(f"| {phase} | {ok} | {p50:.1f} | {p99:.1f} | {served} | {refused} | {r50:.1f} | {r99:.1f} | {rmax:.1f} "
              f"| {other or '-'} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seats", type=int, default=4, help="the decode worker's running seats (max_num_seqs)")
    ap.add_argument("--max-waiting", type=int, default=4, help="admission.max_waiting_per_worker")
    ap.add_argument("--burst", type=int, default=64)
    ap.add_argument("--burst-after-s", type=float, default=1.0, help="after every stream has its seat")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
