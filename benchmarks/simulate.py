"""The cluster simulator's predictions against a real server: TTFT and ITL p50, side by side.

    nice -n 10 python -m benchmarks.simulate [--profile FILE] [--num-requests 5]

1. The step costs: `--profile` (written by `pdserve profile`), else measured here first on an
   engine of the default config (the same model and device the server's workers load).
2. The predictions, printed (and written to --out) before anything is measured: for each
   setup (1 prefill + 1 decode; 1 colocated) and traffic mix, `simulate` at the mix's rate.
3. The measurements: an in-process server of each setup, each mix sent through `pdserve
   bench`'s gRPC backend and load generator (Poisson arrivals, greedy, exact output lengths).
The step costs are the engine's alone; the serving path's own latency (Ray calls, token
polling, gRPC, the KV transfer's handshake) is measured first (unless `--no-calibrate`) on a
server of each setup, for each its own: a colocated worker's first token takes no KV hop but
shares one engine loop with its decodes, so its path is not the disaggregated one. On each,
`--calibration-runs` runs of requests of a shape of neither mix (16 tokens in, 8 out), one at
a time; what the least run's median TTFT and ITL exceed the engine-only prediction by becomes
the profile's overheads for that setup (`ttft_overhead_s`/`itl_overhead_s`, disaggregated;
`colocated_ttft_overhead_s`/`colocated_itl_overhead_s`): the least, as the profiler keeps the
least of its runs, so that a moment of the others' load does not inflate it. What the
prediction still misses is, on a shared CPU, the other processes' load, which the profile saw
at another moment.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import torch

from pdserve.cluster.bench.backends import GrpcBackend
from pdserve.cluster.bench.dataset import random_requests
from pdserve.cluster.bench.report import summarize
from pdserve.cluster.bench.runner import LoadShape, run_load
from pdserve.cluster.server import start_server
from pdserve.cluster.settings.config import config_from_dict
from pdserve.cluster.sim.simulator import Lengths, Split, Traffic, simulate
from pdserve.cluster.sim.step_costs import StepCosts, least_overheads_s

SETUPS = {"1P+1D": ("disaggregated", Split(1, 1)), "colocated": ("colocated", Split(0, 1))}


def _mixes(args: argparse.Namespace) -> dict[str, tuple[float, int, int]]:
    """name -> (requests/s, prompt tokens, output tokens)."""
    return {"chat": (args.chat_rate, 32, 16), "long prompts": (args.long_rate, 256, 4)}


def _profile(args: argparse.Namespace) -> StepCosts:
    if args.profile:
        return StepCosts.load(args.profile)
    from pdserve.cluster.sim.profile_cmd import measure
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import Engine

    torch.set_num_threads(1)  # as a worker's: Ray gives an actor of num_cpus=1 one OpenMP thread
    engine = Engine(EngineConfig())
    try:
        costs = measure(engine, (32, 128, 256), (1, 2, 4), (32, 256), 6)
    finally:
        engine.close()
    layout = engine.kv_wire_layout
    costs = StepCosts(costs.prefill, costs.decode, costs.decode_context_tokens, costs.decode_s_per_context_token,
                      layout.bytes_per_block / layout.block_size, 0.002, 1e9, source="benchmarks/simulate.py")
    if args.out:
        costs.save(args.out.with_suffix(".profile.json"))
    return costs


CALIBRATION = (16, 8)  # prompt and output tokens: a shape of neither mix


async def calibrate(costs: StepCosts, setup: str, n: int, runs: int) -> StepCosts:
    """`costs` with `setup`'s serving overheads: the least of `runs` runs of `n` requests sent
    one at a time to a server of that setup (one server, so runs differ by the moment only)."""
    mode, split = SETUPS[setup]
    config = config_from_dict({"server": {"port": 0, "metrics_port": 0, "http": False},
                               "pools": {"mode": mode, "num_prefill": 1, "num_decode": 1}})
    server = await start_server(config)
    backend = GrpcBackend(f"127.0.0.1:{server.port}", temperature=0.0)
    prompt, output = CALIBRATION
    measured: list[tuple[float, float]] = []
    try:
        vocab = await backend.vocab_size()
        await run_load(backend, random_requests(1, 32, 2, vocab, seed=9), LoadShape(), progress=False)  # warm up
        for i in range(runs):
            run = await run_load(backend, random_requests(n, prompt, output, vocab, seed=3 + i),
                                 LoadShape(max_concurrency=1), progress=False)
            s = summarize(run)
            measured.append((s["median_ttft_ms"], s["median_itl_ms"]))
    finally:
        await backend.close()
        await server.stop()
    pred = simulate(costs.engine_only(), split, Traffic(0.01, Lengths(prompt), Lengths(output), n, poisson=False))
    ttft_s, itl_s = least_overheads_s(measured, (pred.ttft_ms[50], pred.itl_ms[50]))
    print(f"calibration {setup} ({runs} runs of {n} x {prompt} in, {output} out, one at a time): measured (TTFT ms, "
          f"ITL ms) {[(round(t), round(i, 1)) for t, i in measured]}; engine-only prediction {pred.ttft_ms[50]:.0f}, "
          f"{pred.itl_ms[50]:.1f}: overheads (the least) {1e3 * ttft_s:.0f} ms, {1e3 * itl_s:.1f} ms", flush=True)
    return costs.with_overheads(split.colocated, ttft_s, itl_s)


async def measure(mode: str, mixes: dict[str, tuple[float, int, int]], n: int) -> dict[str, dict]:
    config = config_from_dict({"server": {"port": 0, "metrics_port": 0, "http": False},
                               "pools": {"mode": mode, "num_prefill": 1, "num_decode": 1}})
    server = await start_server(config)
    backend = GrpcBackend(f"127.0.0.1:{server.port}", temperature=0.0)
    out = {}
    try:
        vocab = await backend.vocab_size()
        await run_load(backend, random_requests(1, 32, 2, vocab, seed=9), LoadShape(), progress=False)  # warm up
        for name, (rate, prompt, output) in mixes.items():
            run = await run_load(backend, random_requests(n, prompt, output, vocab, seed=1),
                                 LoadShape(request_rate=rate, seed=1), progress=False)
            s = summarize(run)
            out[name] = {"ttft_ms": s["median_ttft_ms"], "itl_ms": s["median_itl_ms"], "failed": s["failed"]}
            print(f"measured {mode} {name}: {out[name]}", flush=True)
    finally:
        await backend.close()
        await server.stop()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default=None, help="step-cost profile (default: measure one first)")
    p.add_argument("--num-requests", type=int, default=5, help="requests per mix and setup")
    p.add_argument("--chat-rate", type=float, default=0.05)
    p.add_argument("--long-rate", type=float, default=0.03)
    p.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated, of {', '.join(SETUPS)}")
    p.add_argument("--no-calibrate", action="store_true",
                   help="predict from the engine's step costs alone (the profile's own overheads, if any)")
    p.add_argument("--calibration-requests", type=int, default=5, help="requests per calibration run")
    p.add_argument("--calibration-runs", type=int, default=3,
                   help="calibration runs per setup; each overhead is the least run's")
    p.add_argument("--out", type=Path, default=None, help="write predictions and measurements (JSON) here")
    args = p.parse_args()
    setups = {name: SETUPS[name] for name in args.setups.split(",")}
    costs = _profile(args)
    if not args.no_calibrate:
        for setup in setups:
            costs = asyncio.run(calibrate(costs, setup, args.calibration_requests, args.calibration_runs))
        if args.out:
            costs.save(args.out.with_suffix(".profile.json"))
    mixes = _mixes(args)
    predicted = {}
    for setup, (_, split) in setups.items():
        for name, (rate, prompt, output) in mixes.items():
            pred = simulate(costs, split, Traffic(rate, Lengths(prompt), Lengths(output), args.num_requests), seed=1)
            predicted[f"{setup}/{name}"] = {"ttft_ms": pred.ttft_ms[50], "itl_ms": pred.itl_ms[50]}
    print("predicted:", json.dumps(predicted), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"profile": costs.to_json(), "predicted": predicted}, indent=1))
    measured = {}
    for setup, (mode, _) in setups.items():
        for name, figures in asyncio.run(measure(mode, mixes, args.num_requests)).items():
            measured[f"{setup}/{name}"] = figures
    if args.out:
        args.out.write_text(json.dumps({"profile": costs.to_json(), "predicted": predicted, "measured": measured},
                                       indent=1))
    print("| setup / mix | TTFT p50 predicted ms | measured | ratio | ITL p50 predicted ms | measured | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for key, pred in predicted.items():
        m = measured[key]
        print(f"| {key} | {pred['ttft_ms']:.0f} | {m['ttft_ms']:.0f} | {pred['ttft_ms'] / m['ttft_ms']:.2f} | "
              f"{pred['itl_ms']:.0f} | {m['itl_ms']:.0f} | {pred['itl_ms'] / m['itl_ms']:.2f} |")


if __name__ == "__main__":
    main()
