"""A benchmark run's figures under `vllm bench serve`'s names (so results compare line by
line), its table, and PNG plots: latency CDFs of a run, throughput and latency against
request rate for a sweep."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from pdserve.cluster.bench.runner import RunResult
from pdserve.cluster.sim.slo import Slo

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2el")
_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
           "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


def summarize(run: RunResult, slo: Slo = Slo()) -> dict[str, float | int | None]:
    """The run's figures: counts, throughputs and, per latency, mean/median/std/p50/p90/p99 in ms."""
    ok = [r for r in run.results if r.ok]
    samples = _samples(run)
    input_tokens = sum(r.input_tokens or 0 for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    duration = run.duration_s
    out: dict[str, float | int | None] = {
        "request_rate": run.shape.request_rate,
        "max_concurrency": run.shape.max_concurrency,
        "duration": duration,
        "completed": len(ok),
        "failed": len(run.results) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    if cached and len(cached) == len(ok):  # the server said, for every request, what came from its caches
        out["total_cached_tokens"] = sum(cached)
        out["total_computed_prompt_tokens"] = input_tokens - sum(cached)
        out["mean_computed_prompt_tokens"] = (input_tokens - sum(cached)) / len(ok)
    if slo.is_set:
        good = sum(1 for r in ok if slo.met_by(r.ttft, r.tpot, r.e2el))
        out["request_goodput"] = good / duration
    for name in LATENCIES:
        ms = np.asarray(samples[name], dtype=np.float64) * 1000.0
        empty = ms.size == 0
        out[f"mean_{name}_ms"] = float("nan") if empty else float(ms.mean())
        out[f"median_{name}_ms"] = float("nan") if empty else float(np.median(ms))
        out[f"std_{name}_ms"] = float("nan") if empty else float(ms.std())
        for p in PERCENTILES:
            out[f"p{p}_{name}_ms"] = float("nan") if empty else float(np.percentile(ms, p))
    return out


def _samples(run: RunResult) -> dict[str, list[float]]:
    """Each latency's samples, seconds, over the run's successful requests."""
    ok = [r for r in run.results if r.ok]
    return {"ttft": [r.ttft for r in ok], "tpot": [t for r in ok if (t := r.tpot) is not None],
            "itl": [gap for r in ok for gap in r.itls], "e2el": [r.e2el for r in ok]}


def format_table(summary: dict[str, float | int | None], errors: list[str] = ()) -> str:
    """The run's table, in vllm bench serve's layout."""
    rate = summary["request_rate"]
    rows: list[tuple[str, object]] = [
        ("Request rate (req/s):", "inf" if rate == math.inf else f"{rate:g}"),
        ("Max request concurrency:", summary["max_concurrency"] or "none"),
        ("Successful requests:", summary["completed"]),
        ("Failed requests:", summary["failed"]),
        ("Benchmark duration (s):", f"{summary['duration']:.2f}"),
        ("Total input tokens:", summary["total_input_tokens"]),
        ("Total generated tokens:", summary["total_output_tokens"]),
    ]
    if "total_cached_tokens" in summary:  # prompt tokens the server computed (not from its KV caches)
        rows += [("Total cached prompt tokens:", summary["total_cached_tokens"]),
                 ("Total computed prompt tokens:", summary["total_computed_prompt_tokens"]),
                 ("Computed prompt tokens per request:", f"{summary['mean_computed_prompt_tokens']:.1f}")]
    rows += [
        ("Request throughput (req/s):", f"{summary['request_throughput']:.2f}"),
    ]
    if "request_goodput" in summary:
        rows.append(("Request goodput (req/s):", f"{summary['request_goodput']:.2f}"))
    rows += [("Output token throughput (tok/s):", f"{summary['output_throughput']:.2f}"),
             ("Total token throughput (tok/s):", f"{summary['total_token_throughput']:.2f}")]
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]
    lines += [f"{label:<40}{value:<10}" for label, value in rows]
    for name in LATENCIES:
        lines.append("{s:{c}^{n}}".format(s=_TITLES[name], n=50, c="-"))
        lines.append(f"{f'Mean {name.upper()} (ms):':<40}{summary[f'mean_{name}_ms']:<10.2f}")
        lines.append(f"{f'Median {name.upper()} (ms):':<40}{summary[f'median_{name}_ms']:<10.2f}")
        for p in PERCENTILES:
            lines.append(f"{f'P{p} {name.upper()} (ms):':<40}{summary[f'p{p}_{name}_ms']:<10.2f}")
    lines.append("=" * 50)
    lines += [f"error: {e}" for e in errors[:5]]
    return "\n".join(lines)


def plot_cdfs(run: RunResult, path: Path) -> None:
    """One PNG: the empirical CDF of each latency of a run."""
    plt = _pyplot()
    samples = _samples(run)
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for ax, name in zip(axes, LATENCIES):
        ms = np.sort(np.asarray(samples[name]) * 1000.0)
        if ms.size:
            ax.step(ms, np.arange(1, ms.size + 1) / ms.size, where="post")
        ax.set_title(_TITLES[name], fontsize=10)
        ax.set_xlabel("ms")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of samples")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_sweep(summaries: list[dict[str, float | int | None]], path: Path) -> None:
    """One PNG for a rate sweep: output throughput, and p50/p99 TTFT and ITL, against rate."""
    plt = _pyplot()
    rates = [s["request_rate"] for s in summaries]
    finite = [r for r in rates if r != math.inf]
    # An `inf` point is drawn at twice the highest finite rate, labelled as such.
    xs = [r if r != math.inf else 2 * max(finite or [1.0]) for r in rates]
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    axes[0].plot(xs, [s["output_throughput"] for s in summaries], marker="o")
    axes[0].set_ylabel("output tok/s")
    for ax, name in ((axes[1], "ttft"), (axes[2], "itl")):
        for p in (50, 99):
            ax.plot(xs, [s[f"p{p}_{name}_ms"] for s in summaries], marker="o", label=f"p{p}")
        ax.set_ylabel(f"{name.upper()} ms")
        ax.legend()
    for ax in axes:
        ax.set_xlabel("request rate (req/s)")
        ax.set_xticks(xs, ["inf" if r == math.inf else f"{r:g}" for r in rates])
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt
