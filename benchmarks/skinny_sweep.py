"""Block configurations of kernels/skinny_gemm.py per shape, at a few rows, against cuBLAS.

    python -m benchmarks.skinny_sweep [--rows 5]   (a GPU; cold weights, CUDA graphs, median of 7)

Prints, per (N, K) of the 8B target and the 1B draft: cuBLAS at the same rows (what the
engine ran before), the one-row GEMV (how fast the weights can be read in this
timing), the configuration `_config` picks and the sweep's best (BLOCK_N, BLOCK_K, S, WN).
A shape whose best beats the pick by a few percent belongs in `_TUNED`. The last line sums
an 8B pass's products (32 layers and the head). The limit is the copy bandwidth, ~4.3 TB/s.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from benchmarks.gemv_sweep import SHAPES, cold_us
from pdserve.kernels import _gluon_skinny_gemm
from pdserve.kernels.gemv import gemv
from pdserve.kernels.skinny_gemm import MAX_ROWS, _config

Config = tuple[int, int, int, int]  # (BLOCK_N, BLOCK_K, S, WN)
PASS_8B = {(6144, 4096): 32, (4096, 4096): 32, (28672, 4096): 32, (4096, 14336): 32, (128256, 4096): 1}


def _configs(k: int) -> list[Config]:
    """Tilings that divide K, at most 8 warps and 128 weight elements a thread a tile."""
    return [(bn, bk, s, wn) for bn, bk, s, wn in itertools.product((16, 32, 64), (64, 128, 256), (1, 2, 4, 8), (1, 2))
            if bn % (16 * wn) == 0 and k % (bk * s) == 0 and s * wn <= 8 and bn * bk // (32 * wn) <= 128]


def time_us(x: torch.Tensor, n: int, config: Config) -> float:
    y = torch.empty(x.shape[0], n, device="cuda", dtype=x.dtype)
    return cold_us(n, x.shape[1], lambda w: _gluon_skinny_gemm.launch(x, w, None, y, *config, False, False))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=5, help=f"rows of x, 2 to {MAX_ROWS} (default: K + 1 at K = 4)")
    rows = ap.parse_args().rows
    if not 2 <= rows <= MAX_ROWS:
        raise SystemExit(f"--rows must be 2 to {MAX_ROWS}, got {rows}")
    print(f"| N | K | cuBLAS {rows} rows us | GEMV 1 row us | current (BLOCK_N, BLOCK_K, S, WN) | us | TB/s "
          "| best of the sweep | us |")
    print("|---:|---:|---:|---:|---|---:|---:|---|---:|")
    totals = [0.0, 0.0, 0.0]
    for n, k in SHAPES:
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        x1 = x[:1].contiguous()
        cublas = cold_us(n, k, lambda w, x=x: F.linear(x, w))
        one_row = cold_us(n, k, lambda w, x1=x1: gemv(x1, w))
        current = _config(n, k)
        assert current is not None
        results = {cfg: time_us(x, n, cfg) for cfg in _configs(k)}
        if current not in results:
            results[current] = time_us(x, n, current)
        best = min(results, key=results.__getitem__)
        for i, us in enumerate((cublas, one_row, results[current])):
            totals[i] += us * PASS_8B.get((n, k), 0)
        print(f"| {n} | {k} | {cublas:.1f} | {one_row:.1f} | {current} | {results[current]:.1f} "
              f"| {n * k * 2 / results[current] / 1e6:.2f} | {best} | {results[best]:.1f} |", flush=True)
    print(f"\n8B pass, products alone (32 layers + head), us: cuBLAS {totals[0]:.0f}, GEMV at one row "
          f"{totals[1]:.0f}, skinny_gemm {totals[2]:.0f}")


if __name__ == "__main__":
    main()
