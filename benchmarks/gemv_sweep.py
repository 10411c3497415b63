"""Block configurations of kernels/gemv.py per shape: the current choice against the best of a sweep.

    python -m benchmarks.gemv_sweep [--v2-lite]   (a GPU; cold weights, CUDA graphs, median of 7 replays)

Prints, per (N, K) of the 8B target and the 1B draft (or, with --v2-lite, of DeepSeek-V2-Lite:
q_proj, kv_a_proj, o_proj, the router, the shared experts, the dense layer, lm_head): the
configuration `_config` picks, its time and bandwidth, and the sweep's best (BLOCK_N, BLOCK_K,
num_warps). A shape whose best beats the pick belongs in `_TUNED`. The limit is the copy bandwidth, ~4.3 TB/s.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from collections.abc import Callable

import torch
import triton

from pdserve.kernels.gemv import _config, _gemv_kernel

SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128256, 2048),  # 1B draft
          (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]  # 8B target
V2_LITE_SHAPES = [(3072, 2048), (576, 2048), (2048, 2048), (64, 2048), (5632, 2048), (2048, 2816),
                  (21888, 2048), (2048, 10944), (102400, 2048)]
CONFIGS = list(itertools.product((4, 8, 16), (256, 512, 1024), (4, 8)))
COLD_BYTES = 400e6  # weights cycled per replay: well over the 50 MB L2, as a model's layers are


def cold_us(n: int, k: int, call: Callable[[torch.Tensor], None]) -> float:
    """Microseconds per `call(weight)`, each call on a different (cold) [n, k] bf16 weight:
    the calls captured in one CUDA graph, the median of 7 replays."""
    copies = max(2, int(COLD_BYTES // (n * k * 2)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]

    def calls() -> None:
        for w in weights:
            call(w)

    return graph_us(calls) / copies


def graph_us(calls: Callable[[], object], replays: int = 7) -> float:
    """Microseconds per replay of `calls` captured in one CUDA graph (warmed up and compiled
    first), the median of `replays` replays."""
    calls()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    graph.replay()
    times = []
    for _ in range(replays):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1e3)
    return statistics.median(times)


def time_us(n: int, k: int, block_n: int, block_k: int, num_warps: int) -> float:
    """Microseconds per call of one configuration."""
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    even = n % block_n == 0 and k % block_k == 0
    return cold_us(n, k, lambda w: _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w, y, y, y, n, w.stride(0), 0, k, HAS_BIAS=False, EVEN=even, SCALED=False, BLOCKED=False,
        BLOCK_N=block_n, BLOCK_K=block_k, PDL=False, READ_AHEAD=False, num_warps=num_warps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--v2-lite", action="store_true", help="DeepSeek-V2-Lite's shapes")
    shapes = V2_LITE_SHAPES if parser.parse_args().v2_lite else SHAPES
    print("| N | K | current (BLOCK_N, BLOCK_K, warps) | us | TB/s | best of the sweep | us | TB/s |")
    print("|---:|---:|---|---:|---:|---|---:|---:|")
    for n, k in shapes:
        current = _config(n, k)
        results = {cfg: time_us(n, k, *cfg) for cfg in CONFIGS if cfg[1] <= k}
        if current not in results:
            results[current] = time_us(n, k, *current)
        best = min(results, key=results.__getitem__)

        def tbs(us: float, n: int = n, k: int = k) -> float:
            return n * k * 2 / us / 1e6

        print(f"| {n} | {k} | {current} | {results[current]:.1f} | {tbs(results[current]):.2f} | {best} "
              f"| {results[best]:.1f} | {tbs(results[best]):.2f} |", flush=True)


if __name__ == "__main__":
    main()
