"""`pdserve bench`: a load generator for a running server, over gRPC or the OpenAI HTTP API.

    pdserve bench --target 127.0.0.1:50051 --num-prompts 200 --input-len 1024 --output-len 128 \\
        --sweep 1,2,4,inf --json results.json --plot plots/

Prompts are random token ids of given lengths (`--dataset random`), the shipped
chat-shaped set (`--dataset synthetic-chat`), a JSONL file, or conversations whose every
turn resends the one before and its answer (`--dataset multi-turn`, gRPC: `multi_turn.py`;
`--num-prompts` conversations of `--num-turns` turns, `--input-len` tokens per user message,
`--num-system-prompts` shared system prompts of `--system-len` tokens, `--max-concurrency`
and `--request-rate` counting conversations). Arrivals are a Poisson
process at `--request-rate` (or all at once), optionally capped at `--max-concurrency`
in flight. Prints vllm bench serve's table per rate (same metric names in `--json`), and
with `--metrics-url` the server's own request and token counts beside the client's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import sys
import urllib.request
from dataclasses import asdict
from pathlib import Path

from pdserve.cluster.bench.backends import Backend, GrpcBackend, OpenAIBackend
from pdserve.cluster.bench.conversations import MultiTurnWorkload, run_multi_turn
from pdserve.cluster.bench.dataset import SYNTHETIC_CHAT, BenchRequest, jsonl_requests, random_requests
from pdserve.cluster.bench.report import format_table, plot_cdfs, plot_sweep, summarize
from pdserve.cluster.bench.runner import LoadShape, RunResult, run_load
from pdserve.cluster.clients.credentials import add_credential_args, from_args
from pdserve.cluster.sim.slo import Slo

__all__ = ["add_parser", "run_bench"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="load-test a running server (gRPC or OpenAI HTTP)")
    p.add_argument("--target", default="127.0.0.1:50051",
                   help="host:port of pdserve's gRPC API, or http(s)://host:port of an OpenAI-compatible API")
    p.add_argument("--model", default=None, help="model name for the OpenAI API (default: the first listed)")
    p.add_argument("--dataset", default="random", help="random, synthetic-chat, multi-turn, or a JSONL file")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=256, help="random prompts: tokens per prompt")
    p.add_argument("--output-len", type=int, default=None,
                   help="tokens per answer (default 128, or a JSONL line's own output_len)")
    p.add_argument("--range-ratio", type=float, default=0.0, help="random lengths vary by +- this fraction")
    p.add_argument("--vocab-size", type=int, default=None, help="random ids below this (default: from the server)")
    p.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns per conversation")
    p.add_argument("--num-system-prompts", type=int, default=4,
                   help="multi-turn: system prompts the conversations share")
    p.add_argument("--system-len", type=int, default=256, help="multi-turn: tokens per system prompt")
    p.add_argument("--request-rate", type=float, default=math.inf, help="req/s, Poisson arrivals (default inf)")
    p.add_argument("--sweep", default=None, help="comma-separated request rates, one run each (e.g. 1,2,4,inf)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--goodput", nargs="*", default=[], metavar="METRIC:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50")
    p.add_argument("--metrics-url", default=None, help="the server's /metrics, read before and after each run")
    p.add_argument("--json", type=Path, default=None, help="write every run's figures here")
    p.add_argument("--plot", type=Path, default=None, help="write PNG plots into this folder")
    p.add_argument("--no-progress", action="store_true")
    add_credential_args(p)
    p.set_defaults(func=lambda args: asyncio.run(run_bench(args)))


async def run_bench(args: argparse.Namespace) -> int:
    rates = [float(r) for r in args.sweep.split(",")] if args.sweep else [args.request_rate]
    slo = Slo.parse(args.goodput)
    shapes = [LoadShape(rate, args.max_concurrency, args.timeout, args.seed) for rate in rates]
    backend = _backend(args)
    try:
        if args.dataset == "multi-turn":
            workload = await _multi_turn(args, backend)
            requests = []
        else:
            requests = await _requests(args, backend)
        summaries = []
        for i, shape in enumerate(shapes):
            before = _scrape(args.metrics_url)
            if args.dataset == "multi-turn":
                run = await run_multi_turn(backend, workload, shape, progress=not args.no_progress)
            else:
                run = await run_load(backend, requests, shape, progress=not args.no_progress)
            summary = summarize(run, slo)
            if args.metrics_url:
                summary.update(_server_counts(before, _scrape(args.metrics_url)))
            summaries.append(summary)
            print(format_table(summary, [r.error for r in run.results if r.error]))
            if args.metrics_url:
                print(f"{'Server: requests OK / tokens generated:':<40}"
                      f"{summary['server_completed']:.0f} / {summary['server_output_tokens']:.0f}")
                print(format_hops(summary))
            if args.plot:
                args.plot.mkdir(parents=True, exist_ok=True)
                plot_cdfs(run, args.plot / f"latency_cdf_{i}_rate_{shape.request_rate:g}.png")
            if args.json:
                _write_json(args.json, args, summaries, run if len(shapes) == 1 else None)
        if args.plot and len(shapes) > 1:
            plot_sweep(summaries, args.plot / "sweep.png")
    finally:
        await backend.close()
    return 0 if all(s["failed"] == 0 for s in summaries) else 1


def _is_http(target: str) -> bool:
    return re.match(r"https?://", target) is not None


def _backend(args: argparse.Namespace) -> Backend:
    if _is_http(args.target):
        return OpenAIBackend(args.target, args.model, args.temperature, from_args(args))
    return GrpcBackend(args.target, args.temperature, from_args(args))


async def _requests(args: argparse.Namespace, backend: Backend) -> list[BenchRequest]:
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be at least 1, got {args.num_prompts}")
    if args.dataset == "random":
        vocab = args.vocab_size or await backend.vocab_size()
        if vocab is None:
            raise ValueError("random prompts need --vocab-size against this API")
        return random_requests(args.num_prompts, args.input_len, args.output_len or _OUTPUT_LEN, vocab,
                               args.range_ratio, args.seed)
    path = SYNTHETIC_CHAT if args.dataset == "synthetic-chat" else Path(args.dataset)
    if not path.is_file():
        raise ValueError(f"--dataset: no such file {path} (or use random or synthetic-chat)")
    return jsonl_requests(path, args.num_prompts, args.output_len, args.seed)


async def _multi_turn(args: argparse.Namespace, backend: Backend) -> MultiTurnWorkload:
    if _is_http(args.target):
        raise ValueError("--dataset multi-turn needs pdserve's gRPC API (it resends the answers' token ids)")
    vocab = args.vocab_size or await backend.vocab_size()
    if vocab is None:
        raise ValueError("multi-turn prompts need --vocab-size against this API")
    return MultiTurnWorkload(args.num_prompts, args.num_turns, args.num_system_prompts, args.system_len,
                             args.input_len, args.output_len or _OUTPUT_LEN, vocab, args.seed)


_OUTPUT_LEN = 128


_COUNTERS = {"server_completed": 'pdserve_requests_total{status="OK"}',
             "server_output_tokens": "pdserve_generated_tokens_total"}


def _scrape(url: str | None) -> dict[str, float]:
    if url is None:
        return {}
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\S+) (\S+)$", text, re.M)}


_HOP = re.compile(r'^pdserve_first_token_hop_seconds_sum\{hop="([^"]+)"\}$')


def _server_counts(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The server's request and token counts over the run, and its first tokens' mean time
    per hop (`hop_<name>_ms`: pdserve_first_token_hop_seconds, the run's observations only)."""
    counts = {key: after.get(name, 0.0) - before.get(name, 0.0) for key, name in _COUNTERS.items()}
    for name in after:
        if (m := _HOP.match(name)) is not None:
            count_name = name.replace("_sum{", "_count{")
            n = after.get(count_name, 0.0) - before.get(count_name, 0.0)
            if n > 0:
                counts[f"hop_{m.group(1)}_ms"] = (after[name] - before.get(name, 0.0)) / n * 1000
    return counts


def format_hops(summary: dict[str, float | int | None]) -> str:
    """One line: the server's mean first-token time per hop, in path order as the server observed them."""
    hops = [(k[4:-3], v) for k, v in summary.items() if k.startswith("hop_") and k.endswith("_ms")]
    return "Server: first token by hop (mean ms):    " + ", ".join(f"{h} {v:.1f}" for h, v in hops)


def _write_json(path: Path, args: argparse.Namespace, summaries: list[dict], run: RunResult | None) -> None:
    doc: dict[str, object] = {
        "backend": "openai" if _is_http(args.target) else "grpc",
        "target": args.target, "dataset": args.dataset, "num_prompts": args.num_prompts,
        "runs": [{k: _jsonable(v) for k, v in s.items()} for s in summaries],
    }
    if run is not None:  # one run: its requests too, as vllm bench serve's --save-detailed does
        doc["requests"] = [{**asdict(r), "chunk_times": [t - r.start for t in r.chunk_times]} for r in run.results]
    path.write_text(json.dumps(doc, indent=1, allow_nan=False))


def _jsonable(value: object) -> object:
    """JSON has no NaN or infinity: an empty latency is null, an unbounded rate "inf"."""
    if isinstance(value, float) and math.isnan(value):
        return None
    return "inf" if value == math.inf else value


if __name__ == "__main__":
    sys.exit("run it as `pdserve bench`")
