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
1 prefill + 1 decode server: requests of a shape of neither mix (16 tokens in, 8 out), one at
a time; what their median TTFT and ITL exceed the simulator's prediction by becomes the
profile's `ttft_overhead_s` and `itl_overhead_s` (the colocated setup is predicted with the
same). What the prediction still misses is, on a shared CPU, the other processes' load,
which the profile saw at another moment.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
from pathlib import Path

import torch

from pdserve.cluster.bench.backends import GrpcBackend
from pdserve.cluster.bench.dataset import random_requests
from pdserve.cluster.bench.report import summarize
from pdserve.cluster.bench.runner import LoadShape, run_load
from pdserve.cluster.config import config_from_dict
from pdserve.cluster.server import start_server
from pdserve.cluster.simulator import Lengths, Split, Traffic, simulate
from pdserve.cluster.step_costs import StepCosts

SETUPS = {"1P+1D": ("disaggregated", Split(1, 1)), "colocated": ("colocated", Split(0, 1))}


def _mixes(args: argparse.Namespace) -> dict[str, tuple[float, int, int]]:
    """name -> (requests/s, prompt tokens, output tokens)."""
    return {"chat": (args.chat_rate, 32, 16), "long prompts": (args.long_rate, 256, 4)}


def _profile(args: argparse.Namespace) -> StepCosts:
    if args.profile:
        return StepCosts.load(args.profile)
    from pdserve.cluster.profiler import measure
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


async def calibrate(costs: StepCosts, n: int) -> StepCosts:
    """`costs` with the serving overheads a 1P+1D server shows on `n` requests sent one at a time."""
    config = config_from_dict({"server": {"port": 0, "metrics_port": 0, "http": False},
                               "pools": {"mode": "disaggregated", "num_prefill": 1, "num_decode": 1}})
    server = await start_server(config)
    backend = GrpcBackend(f"127.0.0.1:{server.port}", temperature=0.0)
    prompt, output = CALIBRATION
    try:
        vocab = await backend.vocab_size()
        await run_load(backend, random_requests(1, 32, 2, vocab, seed=9), LoadShape(), progress=False)  # warm up
        run = await run_load(backend, random_requests(n, prompt, output, vocab, seed=3),
                             LoadShape(max_concurrency=1), progress=False)
    finally:
        await backend.close()
        await server.stop()
    s = summarize(run)
    pred = simulate(costs, Split(1, 1), Traffic(0.01, Lengths(prompt), Lengths(output), n, poisson=False))
    ttft_s = max(0.0, (s["median_ttft_ms"] - pred.ttft_ms[50]) / 1e3)
    itl_s = max(0.0, (s["median_itl_ms"] - pred.itl_ms[50]) / 1e3)
    print(f"calibration ({n} x {prompt} in, {output} out, one at a time): measured TTFT {s['median_ttft_ms']:.0f} "
          f"ms, ITL {s['median_itl_ms']:.1f} ms; engine-only prediction {pred.ttft_ms[50]:.0f}, "
          f"{pred.itl_ms[50]:.1f}: overheads {1e3 * ttft_s:.0f} ms, {1e3 * itl_s:.1f} ms", flush=True)
    return dataclasses.replace(costs, ttft_overhead_s=ttft_s, itl_overhead_s=itl_s)


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
    p.add_argument("--calibration-requests", type=int, default=5)
    p.add_argument("--out", type=Path, default=None, help="write predictions and measurements (JSON) here")
    args = p.parse_args()
    setups = {name: SETUPS[name] for name in args.setups.split(",")}
    costs = _profile(args)
    if not args.no_calibrate:
        costs = asyncio.run(calibrate(costs, args.calibration_requests))
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
