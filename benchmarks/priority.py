"""Who goes first under overload: request priorities and the tenants' fair share (issue 56).

    python -m benchmarks.priority [--seats 4] [--max-waiting 4] [--flood-factor 3] [--duration-s 30]
                                  [--tenant-a-fraction 0.75] [--device cpu]

One in-process server (disaggregated where it can; the default model, on the CPU by default,
`--model` for another), with `--seats` running seats and a queue of `--max-waiting` per decode
worker, and a tenants file of three tenants of equal weight: `i` (the interactive stream), `a`
and `b` (the flood). First its capacity: the completed requests/s of a saturating batch of
`--output-len`-token requests. Then for `--duration-s`, with and without the policy: an
interactive stream (one request every `--interactive-every-s`) beside a batch flood at
`--flood-factor` x capacity, `--tenant-a-fraction` of it from tenant `a` and the rest from `b`
(unequal, so that arrival order alone would not share fairly: 0.75 gives fcfs a 3:1 split,
and each tenant's demand above half the capacity keeps both backlogged). With the policy the
interactive requests have priority -1, the flood 1, and the engines preempt by priority
(`engine.scheduler.policy` "priority"); without it every request has priority 0 (fcfs) and no
tenants file is given. Prints each class's TTFT p50/p99 (and the interactive stream's alone,
unloaded) and refusals, each flood tenant's share of the output tokens served over the window
in which both have backlog (an admitted request, waiting or running; tokens placed at the
times of the chunks that carried them), and where the interactive class's first token spends
its time, hop by hop. The issue's goals: the interactive TTFT p99 under the flood within 2x
its unloaded p99; each of the two equal-weight tenants within 10% of half the tokens.

On the device machine's 16 CPU cores (each worker, the frontend and the load generator on
cores of their own, which the 2-core CI machine cannot give): the Ray wheels as
/work/shared/device/README.md says, the default model's GGUF carried in parts, then
`python -m benchmarks.priority --device cpu --model /tmp/model/SmolLM2-135M-Instruct.Q4_1.gguf`
(benchmarks/RESULTS.md, "Priorities and tenants: the commands for the device machine").
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from pdserve.cluster.bench.backends import GrpcBackend, RequestResult
from pdserve.cluster.bench.dataset import random_requests
from pdserve.cluster.clients.credentials import ClientCredentials
from pdserve.cluster.server import start_server
from pdserve.cluster.serving.coordinator import DISAGGREGATED_HOPS, Coordinator, RequestReport
from pdserve.cluster.settings.config import config_from_dict
from pdserve.engine.messages import WorkerRequest

KEYS = {"i": "bench-key-i", "a": "bench-key-a", "b": "bench-key-b"}
FLOOD = ("a", "b")


def backlog_share(flooded: dict[str, list[RequestResult]]) -> tuple[dict[str, float], float]:
    """Each tenant's output tokens over the time in which every one of them has backlog (an
    admitted request between its sending and its last chunk), and that window's length in s.
    A chunk's tokens are placed at its time (each chunk's share of the request's tokens)."""
    spans = {t: _union([(r.start, r.chunk_times[-1]) for r in rs if r.ok]) for t, rs in flooded.items()}
    window = spans[next(iter(spans))]
    for t in spans:
        window = _intersect(window, spans[t])
    tokens = {t: sum(r.output_tokens / len(r.chunk_times) for r in rs if r.ok for c in r.chunk_times
                     if any(a <= c <= b for a, b in window)) for t, rs in flooded.items()}
    return tokens, sum(b - a for a, b in window)


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _intersect(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> list[tuple[float, float]]:
    return [(max(a, c), min(b, d)) for a, b in x for c, d in y if max(a, c) < min(b, d)]


def _ms(results: list[RequestResult], q: float) -> float:
    ttfts = [r.ttft for r in results if r.ok]
    return float(np.percentile(ttfts, q)) * 1000 if ttfts else float("nan")


class _HopRecorder:
    """The frontend's coordinator, keeping each request's report (its first token's hops,
    `RequestReport.hops`) by priority, so that a class's TTFT can be taken apart hop by hop."""

    def __init__(self, coordinator: Coordinator) -> None:
        self._coordinator = coordinator
        self.reports: list[tuple[int, RequestReport]] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self._coordinator, name)

    def generate(self, req: WorkerRequest, report: RequestReport | None = None,  # noqa: ANN201 - the wrapped one's
                 *args: object):
        if report is not None:
            self.reports.append((req.params.priority, report))
        return self._coordinator.generate(req, report, *args)

    def hops_ms(self, priority: int) -> dict[str, tuple[float, float]]:
        """Hop -> (mean, max) ms over the recorded requests of `priority` that had a first token."""
        hops = [r.hops for p, r in self.reports if p == priority and "seat" in r.hops]
        return {h: (float(np.mean([x.get(h, 0.0) for x in hops])) * 1000, max(x.get(h, 0.0) for x in hops) * 1000)
                for h in DISAGGREGATED_HOPS if hops}


async def _stream(backend: GrpcBackend, requests: list, every_s: float, until: float) -> list[RequestResult]:
    """Send `requests` one every `every_s` until `until` (perf_counter), each on its own; their results."""
    tasks = []
    for request in requests:
        if time.perf_counter() >= until:
            break
        tasks.append(asyncio.create_task(backend.send(request, 600)))
        await asyncio.sleep(every_s)
    return list(await asyncio.gather(*tasks))


async def _run(args: argparse.Namespace, policy: bool, tenants_file: str) -> dict[str, object]:
    import ray

    config = config_from_dict({"server": {"port": 0, "http": False, "metrics_port": 0,
                                          "tenants_file": tenants_file if policy else ""},
                               "admission": {"max_waiting_per_worker": args.max_waiting},
                               # On the CPU no worker asks for a GPU (else, on a machine of one
                               # GPU, the two workers would not fit it and serve colocated).
                               "pools": {"gpus_per_worker": 0.0} if args.device == "cpu" else {},
                               "engine": {"model": {"source": args.model, "device": args.device},
                                          "scheduler": {"max_num_seqs": args.seats,
                                                        "policy": "priority" if policy else "fcfs"}}})
    server = await start_server(config)
    recorder = _HopRecorder(server.frontend.coordinator)
    server.frontend.coordinator = recorder
    target = f"127.0.0.1:{server.port}"

    def backend(tenant: str, priority: int) -> GrpcBackend:
        return GrpcBackend(target, 0.0, ClientCredentials(api_key=KEYS[tenant] if policy else None),
                           priority if policy else 0)

    interactive, flood = backend("i", -1), {t: backend(t, 1) for t in FLOOD}
    try:
        vocab = await interactive.vocab_size() or 32000
        out = args.output_len
        await interactive.send(random_requests(1, args.prompt_len, 4, vocab, seed=99)[0], 600)  # warm up
        # Capacity: a batch as large as the seats and queues take, completed requests/s.
        batch = random_requests(2 * args.seats, args.prompt_len, out, vocab, seed=1)
        start = time.perf_counter()
        done = await asyncio.gather(*(flood["a"].send(r, 600) for r in batch))
        capacity_rps = sum(r.ok for r in done) / (time.perf_counter() - start)
        asks = random_requests(args.num_interactive, args.prompt_len, out, vocab, seed=2)
        recorder.reports.clear()  # the warm-up's and the capacity batch's
        alone = await _stream(interactive, asks, args.interactive_every_s, float("inf"))
        hops_alone = recorder.hops_ms(-1 if policy else 0)
        recorder.reports.clear()
        until = time.perf_counter() + args.duration_s
        fractions = {"a": args.tenant_a_fraction, "b": 1.0 - args.tenant_a_fraction}
        floods = [_stream(flood[t], random_requests(10_000, args.prompt_len, out, vocab, seed=3 + i),
                          1.0 / (args.flood_factor * capacity_rps * fractions[t]), until)
                  for i, t in enumerate(FLOOD)]
        loaded, *flooded = await asyncio.gather(_stream(interactive, asks, args.interactive_every_s, until), *floods)
    finally:
        for b in (interactive, *flood.values()):
            await b.close()
        await server.stop()
        ray.shutdown()
    tokens = {t: sum(r.output_tokens for r in rs) for t, rs in zip(FLOOD, flooded)}
    backlogged, window_s = backlog_share(dict(zip(FLOOD, flooded)))
    refused = {t: sum(bool(r.error) for r in rs) for t, rs in zip(FLOOD, flooded)}
    return {"capacity_rps": capacity_rps, "alone": alone, "loaded": loaded, "flood": [r for rs in flooded for r in rs],
            "by_tenant": dict(zip(FLOOD, flooded)),
            "tokens": tokens, "backlogged": backlogged, "window_s": window_s, "refused": refused,
            "hops_alone": hops_alone,
            "hops_loaded": recorder.hops_ms(-1 if policy else 0)}


async def main_async(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as folder:
        tenants_file = Path(folder) / "tenants.yaml"
        entries = "".join(f"  - {{name: {t}, api_keys: [{k}]}}\n" for t, k in KEYS.items())
        tenants_file.write_text(f"tenants:\n{entries}")
        rows = [(policy, await _run(args, policy, str(tenants_file))) for policy in (False, True)]
    print(f"\n{args.seats} seats, queue {args.max_waiting}, flood {args.flood_factor}x capacity for "
          f"{args.duration_s:g} s ({args.tenant_a_fraction:.0%} of it tenant a's), prompts {args.prompt_len} tokens, "
          f"outputs {args.output_len}, model {args.model} on {args.device}; {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f} at the end")
    print("| policy | capacity req/s | interactive alone TTFT p50/p99 ms | interactive under flood p50/p99 ms "
          "| **p99 ratio** | interactive refused | flood TTFT p50/p99 ms | flood refused a/b "
          "| flood tokens a/b, whole run | **both backlogged: tokens a/b (a's share)**, window s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for policy, r in rows:
        tokens, refused, backlogged = r["tokens"], r["refused"], r["backlogged"]
        share = backlogged["a"] / max(1.0, backlogged["a"] + backlogged["b"])
        loaded = r["loaded"]
        print(f"| {'priority + tenants' if policy else 'fcfs'} | {r['capacity_rps']:.2f} "
              f"| {_ms(r['alone'], 50):.0f} / {_ms(r['alone'], 99):.0f} "
              f"| {_ms(loaded, 50):.0f} / {_ms(loaded, 99):.0f} | {_ms(loaded, 99) / _ms(r['alone'], 99):.1f}x "
              f"| {sum(bool(x.error) for x in loaded)} of {len(loaded)} "
              f"| {_ms(r['flood'], 50):.0f} / {_ms(r['flood'], 99):.0f} | {refused['a']} / {refused['b']} "
              f"| {tokens['a']} / {tokens['b']} | {backlogged['a']:.0f} / {backlogged['b']:.0f} ({share:.0%}), "
              f"{r['window_s']:.1f} |")
    for policy, r in rows:
        errors = sorted({str(x.error)[:100] for x in r["loaded"] if x.error})
        print(f"interactive refusals, {'priority + tenants' if policy else 'fcfs'}: {errors or '-'}")
    print("\nWhere the first token's time goes, mean / max ms per hop (fcfs: every request; with the policy: the "
          "interactive class's); the rest of the TTFT is the frontend's and the first delta's way out")
    print("| policy | phase | " + " | ".join(DISAGGREGATED_HOPS) + " |")
    print("|---|---|" + "---:|" * len(DISAGGREGATED_HOPS))
    for policy, r in rows:
        for phase in ("alone", "loaded"):
            hops = r[f"hops_{phase}"]
            print(f"| {'priority + tenants' if policy else 'fcfs'} | {phase} | "
                  + " | ".join(f"{hops[h][0]:.0f} / {hops[h][1]:.0f}" if h in hops else "-" for h in DISAGGREGATED_HOPS)
                  + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cpu", help="the workers' device (ModelConfig.device): cpu, auto, cuda")
    ap.add_argument("--tenant-a-fraction", type=float, default=0.75, help="tenant a's part of the flood (b: the rest)")
    ap.add_argument("--seats", type=int, default=4, help="the decode worker's running seats (max_num_seqs)")
    ap.add_argument("--max-waiting", type=int, default=4, help="admission.max_waiting_per_worker")
    ap.add_argument("--flood-factor", type=float, default=3.0, help="the flood's rate, in multiples of capacity")
    ap.add_argument("--duration-s", type=float, default=30.0)
    ap.add_argument("--num-interactive", type=int, default=20)
    ap.add_argument("--interactive-every-s", type=float, default=1.0)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=16)
    args = ap.parse_args()
    if not 0.0 < args.tenant_a_fraction < 1.0:
        ap.error(f"--tenant-a-fraction must be in (0, 1), got {args.tenant_a_fraction}")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
