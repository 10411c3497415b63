"""`pdserve simulate`: predicted TTFT, ITL and goodput of a pool split for a traffic mix, from
a step-cost profile (`pdserve profile` measures one); `--budget N` tries every split of N
workers, the planner's question."""

from __future__ import annotations

import argparse
import json
from typing import Any

from pdserve.cluster.sim.simulator import Lengths, Prediction, Split, Traffic, simulate
from pdserve.cluster.sim.slo import Slo
from pdserve.cluster.sim.step_costs import StepCosts


def _lengths(text: str) -> Lengths:
    """MEAN or MEAN:SPREAD (uniform over mean·(1 ± spread))."""
    mean, _, spread = text.partition(":")
    try:
        return Lengths(int(mean), float(spread) if spread else 0.0)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected MEAN or MEAN:SPREAD, got {text!r} ({e})") from e


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `simulate` on the `pdserve` subcommand parsers."""
    p = subparsers.add_parser("simulate", help="predict TTFT, ITL and goodput of a pool split from measured step "
                                               "costs (cluster simulator)", description=__doc__)
    p.add_argument("--profile", required=True, help="step-cost profile JSON (pdserve profile writes one)")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (0: colocated workers only)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (or colocated ones with --prefill 0)")
    p.add_argument("--budget", type=int, default=None, metavar="N",
                   help="try every disaggregated split of N workers (and N colocated) instead")
    p.add_argument("--rate", type=float, required=True, help="requests/s")
    p.add_argument("--requests", type=int, default=1000, help="requests to simulate")
    p.add_argument("--prompt", type=_lengths, default=Lengths(256), help="prompt tokens, MEAN[:SPREAD]")
    p.add_argument("--output", type=_lengths, default=Lengths(64), help="output tokens, MEAN[:SPREAD]")
    p.add_argument("--even", action="store_true", help="evenly spaced arrivals instead of Poisson")
    p.add_argument("--ttft-ms", type=float, default=float("inf"), help="goodput's TTFT objective")
    p.add_argument("--itl-ms", type=float, default=float("inf"), help="goodput's ITL (per-request mean) objective")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    p.set_defaults(func=cmd_simulate)
    return p


def cmd_simulate(args: argparse.Namespace) -> int:
    costs = StepCosts.load(args.profile)
    traffic = Traffic(args.rate, args.prompt, args.output, args.requests, poisson=not args.even)
    slo = Slo(ttft_ms=args.ttft_ms, tpot_ms=args.itl_ms)
    if args.budget is not None:
        if args.budget < 1:
            raise ValueError(f"--budget must be >= 1, got {args.budget}")
        splits = [Split(p, args.budget - p) for p in range(1, args.budget)] + [Split(0, args.budget)]
    else:
        splits = [Split(args.prefill, args.decode)]
    predictions = [simulate(costs, s, traffic, slo, args.seed) for s in splits]
    if args.json:
        for pred in predictions:
            print(json.dumps(_as_json(pred)))
    else:
        print_table(predictions)
    return 0


def print_table(predictions: list[Prediction]) -> None:
    print("| split | TTFT p50 | p90 | p99 | ITL p50 | p90 | p99 | TPOT p90 | SLO met | goodput req/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for p in predictions:
        print(f"| {p.split} | {p.ttft_ms[50]:.1f} | {p.ttft_ms[90]:.1f} | {p.ttft_ms[99]:.1f} | {p.itl_ms[50]:.1f} | "
              f"{p.itl_ms[90]:.1f} | {p.itl_ms[99]:.1f} | {p.tpot_ms[90]:.1f} | {100 * p.attainment:.0f}% | "
              f"{p.goodput:.2f} |")


def _as_json(p: Prediction) -> dict[str, object]:
    return {"prefill": p.split.num_prefill, "decode": p.split.num_decode, "requests": p.num_requests,
            "ttft_ms": p.ttft_ms, "itl_ms": p.itl_ms, "tpot_ms": p.tpot_ms, "duration_s": p.duration_s,
            "attainment": p.attainment, "goodput": p.goodput}
