"""The planner through a traffic shift, against the best fixed split for the shift's first half
(issue 40's measure): the share of requests that meet both latency targets.

    nice -n 10 python -m benchmarks.planner_shift --profile FILE [--phase-s 150] [--out shift.json]

1. A disaggregated server of the default model on the CPU (real Ray actors, UCX, gRPC) with the
   fixed split (`--fixed`, 1 prefill + 2 decode): one request of each phase's shape at a time
   measures the unloaded TTFT and ITL (a request's mean gap between tokens); the targets are
   2x the unloaded TTFT and 1.5x the unloaded ITL, of the phase whose figure is the larger
   (a target must hold for both phases' requests).
2. The traffic, identical for both runs (Poisson arrivals, greedy, exact output lengths, sent
   through `pdserve bench`'s gRPC backend): phase 1, short prompts and long answers (decode
   bound: the fixed split's two decode workers keep the ITL down), then phase 2, long prompts
   and short answers (prefill bound: one prefill worker queues).
3. The same traffic on a server that starts with the same split and the planner on
   (`pools.planner`, short intervals for a run of minutes), within the same budget of workers.
Prints, per run, phase and overall: the share meeting both targets, TTFT and ITL p50/p99; and
the planner's decisions (those not "hold") and role changes with their times from the start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from pdserve.cluster.bench.backends import GrpcBackend, RequestResult
from pdserve.cluster.bench.dataset import BenchRequest, random_requests
from pdserve.cluster.ray_driver import init_ray
from pdserve.cluster.server import Server, start_server
from pdserve.cluster.settings.config import config_from_dict
from pdserve.cluster.settings.pool_config import PlannerConfig
from pdserve.cluster.sim.simulator import Lengths, Split, Traffic, simulate
from pdserve.cluster.sim.slo import Slo
from pdserve.cluster.sim.step_costs import StepCosts

TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    input_len: int
    output_len: int
    rate_per_s: float


@dataclass(frozen=True, slots=True)
class Targets:
    ttft_ms: float
    itl_ms: float

    def met(self, r: RequestResult) -> bool:
        return r.ok and r.ttft * 1e3 <= self.ttft_ms and (r.tpot is None or r.tpot * 1e3 <= self.itl_ms)


@dataclass(frozen=True, slots=True)
class Sent:
    phase: int
    at_s: float  # its planned arrival, from the run's start
    request: BenchRequest


def traffic(phases: tuple[Phase, ...], phase_s: float, vocab: int, seed: int) -> list[Sent]:
    """Each phase's Poisson arrivals over `phase_s` seconds, one after the other."""
    rng, out = random.Random(seed), []
    for i, phase in enumerate(phases):
        times, t = [], rng.expovariate(phase.rate_per_s)
        while t < phase_s:
            times.append(i * phase_s + t)
            t += rng.expovariate(phase.rate_per_s)
        requests = random_requests(len(times), phase.input_len, phase.output_len, vocab, seed=seed + 1 + i)
        out += [Sent(i, at, r) for at, r in zip(times, requests)]
    return out


async def send_all(backend: GrpcBackend, sent: list[Sent]) -> tuple[float, list[RequestResult], list[float]]:
    """Sends each request at its time; returns the run's start (perf_counter), the results, and
    the machine's 1-minute load average every 10 s meanwhile (others' jobs share its cores)."""
    start = time.perf_counter()
    loads: list[float] = []

    async def one(s: Sent) -> RequestResult:
        await asyncio.sleep(max(0.0, start + s.at_s - time.perf_counter()))
        return await backend.send(s.request, TIMEOUT_S)

    async def sample() -> None:
        while True:
            loads.append(float(Path("/proc/loadavg").read_text().split()[0]))
            await asyncio.sleep(10)

    sampler = asyncio.create_task(sample())
    try:
        results = list(await asyncio.gather(*(one(s) for s in sent)))
    finally:
        sampler.cancel()
    return start, results, loads


async def unloaded(backend: GrpcBackend, phases: tuple[Phase, ...], vocab: int, n: int) -> list[tuple[float, float]]:
    """Per phase: the median TTFT and ITL (ms) of `n` requests of its shape, one at a time."""
    out = []
    for i, phase in enumerate(phases):
        warm = random_requests(1, phase.input_len, phase.output_len, vocab, seed=900 + i)
        await backend.send(warm[0], TIMEOUT_S)
        results = [await backend.send(r, TIMEOUT_S)
                   for r in random_requests(n, phase.input_len, phase.output_len, vocab, seed=800 + i)]
        if not all(r.ok for r in results):
            raise RuntimeError(f"unloaded requests failed: {[r.error for r in results if not r.ok]}")
        out.append((1e3 * statistics.median(r.ttft for r in results),
                    1e3 * statistics.median(r.tpot for r in results if r.tpot is not None)))
    return out


class Decisions(logging.Handler):
    """The planner's and the admin API's log lines (not holds), with their times."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith(("planner:", "admin:")):
            self.lines.append((record.created, msg))


async def run_once(args: argparse.Namespace, split: Split, planner: dict[str, object] | None,
                   phases: tuple[Phase, ...], targets: Targets | None) -> dict[str, object]:
    """One server; the unloaded measurement when `targets` is None; then the traffic (unless
    the fixed split's traffic comes after the planner's)."""
    pools: dict[str, object] = {"mode": "disaggregated", "num_prefill": split.num_prefill,
                                "num_decode": split.num_decode}
    if planner is not None:
        pools["planner"] = planner
    server: Server = await start_server(config_from_dict(
        {"server": {"port": 0, "metrics_port": 0, "http": False}, "pools": pools}))
    backend = GrpcBackend(f"127.0.0.1:{server.port}", temperature=0.0)
    out: dict[str, object] = {}
    try:
        vocab = await backend.vocab_size()
        if targets is None:
            measured = await unloaded(backend, phases, vocab, args.unloaded_requests)
            out["unloaded"] = measured
            print(f"unloaded (TTFT ms, ITL ms) per phase: {measured}", flush=True)
            if args.fixed_after:
                return out
        else:  # warm the workers as the unloaded measurement did on the first server
            for i, phase in enumerate(phases):
                await backend.send(random_requests(1, phase.input_len, phase.output_len, vocab, seed=900 + i)[0],
                                   TIMEOUT_S)
        out["sent"] = traffic(phases, args.phase_s, vocab, args.seed)
        decisions = Decisions()
        logging.getLogger("pdserve.cluster").addHandler(decisions)
        wall0 = time.time()
        start, out["results"], out["loads"] = await send_all(backend, out["sent"])  # type: ignore[arg-type]
        logging.getLogger("pdserve.cluster").removeHandler(decisions)
        out["start"] = start
        out["decisions"] = [(t - wall0, msg) for t, msg in decisions.lines]
    finally:
        await backend.close()
        await server.stop()
    return out


def rows(name: str, run: dict[str, object], phases: tuple[Phase, ...], targets: Targets) -> list[str]:
    sent: list[Sent] = run["sent"]  # type: ignore[assignment]
    results: list[RequestResult] = run["results"]  # type: ignore[assignment]
    out = []
    for label, which in [*((p.name, {i}) for i, p in enumerate(phases)), ("overall", set(range(len(phases))))]:
        rs = [r for s, r in zip(sent, results) if s.phase in which]
        ok = [r for r in rs if r.ok]
        ttft = np.asarray([r.ttft for r in ok]) * 1e3
        itl = np.asarray([r.tpot for r in ok if r.tpot is not None]) * 1e3
        met = sum(targets.met(r) for r in rs)

        def p(a: np.ndarray, q: int) -> str:
            return f"{np.percentile(a, q):.0f}" if a.size else "-"

        out.append(f"| {name} | {label} | {len(rs)} | {len(rs) - len(ok)} | {100 * met / max(1, len(rs)):.1f}% | "
                   f"{p(ttft, 50)} | {p(ttft, 99)} | {p(itl, 50)} | {p(itl, 99)} |")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", required=True, help="step-cost profile for the planner (pdserve profile)")
    p.add_argument("--fixed", default="1,2", help="the fixed split, prefill,decode (the best for phase 1)")
    p.add_argument("--phase-s", type=float, default=150.0, help="seconds of arrivals per phase")
    p.add_argument("--phase1", default="32,64,0.5", help="input tokens, output tokens, requests/s")
    p.add_argument("--phase2", default="256,4,1.0", help="input tokens, output tokens, requests/s")
    p.add_argument("--unloaded-requests", type=int, default=3)
    p.add_argument("--interval-s", type=float, default=5.0, help="the planner's interval")
    p.add_argument("--fixed-after", action="store_true",
                   help="run the fixed split's traffic after the planner's (the first server measures the "
                        "unloaded figures only): the other order, against drift in the machine's load")
    p.add_argument("--correction-intervals", type=int, default=PlannerConfig().correction_intervals,
                   help="the planner's correction factor: the median of this many intervals' observed/predicted "
                        "ratios (0: the simulator's predictions as they are, as in runs 1-4)")
    p.add_argument("--drain-deadline-s", type=float, default=PlannerConfig().drain_deadline_s,
                   help="how long a worker the planner moves may finish its streams before they move on")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=None, help="write every request's figures (JSON) here")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for name in ("pdserve.cluster.scaling.planner", "pdserve.cluster.scaling.planner_loop",
                 "pdserve.cluster.scaling.elastic"):
        logging.getLogger(name).setLevel(logging.INFO)
    phases = tuple(Phase(name, int(i), int(o), float(r)) for name, (i, o, r) in
                   (("phase 1 (short prompts, long answers)", args.phase1.split(",")),
                    ("phase 2 (long prompts, short answers)", args.phase2.split(","))))
    split = Split(*(int(n) for n in args.fixed.split(",")))
    costs = StepCosts.load(args.profile)
    budget = split.num_prefill + split.num_decode
    init_ray(None, "127.0.0.1", num_cpus=2 * budget)  # the workers' num_cpus=1 each, on a 2-core machine

    first = asyncio.run(run_once(args, split, None, phases, None))  # the unloaded figures, and the fixed run
    unl: list[tuple[float, float]] = first["unloaded"]  # type: ignore[assignment]
    targets = Targets(2 * max(t for t, _ in unl), 1.5 * max(i for _, i in unl))
    print(f"targets: TTFT {targets.ttft_ms:.0f} ms, ITL {targets.itl_ms:.0f} ms", flush=True)
    for i, ph in enumerate(phases):  # the simulator's view of each split of the budget, per phase
        for num_prefill in range(1, budget):
            s = Split(num_prefill, budget - num_prefill)
            pred = simulate(costs, s, Traffic(ph.rate_per_s, Lengths(ph.input_len), Lengths(ph.output_len), 300),
                            Slo(ttft_ms=targets.ttft_ms, tpot_ms=targets.itl_ms))
            print(f"predicted phase {i + 1} {s}: TTFT p90 {pred.ttft_ms[90]:.0f} ms, ITL p90 {pred.tpot_ms[90]:.0f} ms",
                  flush=True)
    planner = {"enabled": True, "profile": args.profile, "ttft_target_ms": targets.ttft_ms,
               "itl_target_ms": targets.itl_ms, "max_workers": budget, "interval_s": args.interval_s,
               "window_s": 3 * args.interval_s, "min_change_interval_s": 6 * args.interval_s, "hysteresis": 2,
               "min_requests": 5, "sim_requests": 200, "correction_intervals": args.correction_intervals,
               "drain_deadline_s": args.drain_deadline_s}
    planned = asyncio.run(run_once(args, split, planner, phases, targets))
    fixed = asyncio.run(run_once(args, split, None, phases, targets)) if args.fixed_after else first

    print(f"\ntargets: TTFT {targets.ttft_ms:.0f} ms, ITL {targets.itl_ms:.0f} ms (unloaded: {unl})")
    print("| run | traffic | requests | failed | meet both | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for line in rows(f"fixed {split}", fixed, phases, targets) + rows("planner", planned, phases, targets):
        print(line)
    for name, run in (("fixed", fixed), ("planner", planned)):
        loads: list[float] = run["loads"]  # type: ignore[assignment]
        print(f"{name} run: load average (1 min) mean {statistics.mean(loads):.1f}, min {min(loads):.1f}, "
              f"max {max(loads):.1f} on {os.cpu_count()} cores")
    print(f"\nplanner's decisions (phase 2 starts at {args.phase_s:.0f} s):")
    for t, msg in planned["decisions"]:  # type: ignore[union-attr]
        print(f"  {t:7.1f} s  {msg[:400]}")
    if args.out:
        args.out.write_text(json.dumps({
            "targets": asdict(targets), "unloaded": unl, "args": {k: str(v) for k, v in vars(args).items()},
            "runs": {name: {"decisions": run["decisions"], "loads": run["loads"], "requests": [
                {"phase": s.phase, "at_s": s.at_s, "start_s": r.start - run["start"],
                 "ttft_ms": r.ttft * 1e3 if r.ok else None, "itl_ms": r.tpot * 1e3 if r.tpot else None,
                 "error": r.error} for s, r in zip(run["sent"], run["results"])]}
                for name, run in (("fixed", fixed), ("planner", planned))}}, indent=1))


if __name__ == "__main__":
    main()
