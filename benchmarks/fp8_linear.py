"""The linear layers of one Llama-3.1-8B decoder layer (qkv 6144x4096, o 4096x4096, gate/up
28672x4096, down 4096x14336) at M rows, FP8 weights against bf16, one GPU:

- bf16: torch's F.linear (cuBLAS) on bf16 weights, the baseline;
- fp8 dispatch: `engine.models.fp8.linear` as the engine calls it (gemv, fp8_gemm, or the
  scaled matmul with x quantized by `kernels.fp8_quant`);
- scaled_mm, torch quant: cuBLASLt's row-wise scaled FP8 matmul with x quantized per token
  in torch ops (the dispatch's large-M path before `kernels.fp8_quant`);
- scaled_mm, fused quant: the same with `kernels.fp8_quant.quantize_per_token`;
- fast accum: the same with cuBLASLt's fast accumulation (`use_fast_accum`: the FP8 tensor
  cores' own accumulator, not promoted to float32 along K; what vLLM's CUTLASS FP8 kernels on
  Hopper use), to see what it is worth before the engine offers it;
- fp8_gemm: the Triton W8A16 kernel (x unquantized);
- w8a8: `kernels.fp8_w8a8` (x quantized per token, e4m3 x e4m3 dots) at its table's tile,
  through the dispatch's opt-in (`fp8.linear(..., w8a8=True)`), up to 512 rows.

    python -m benchmarks.fp8_linear [--rows 1 16 64 256 512 4096]
    python -m benchmarks.fp8_linear --sweep [--sweep-rows 2 8 16 32 64 128 256 512] [--blocked]

`--sweep` times each of fp8_w8a8's candidate tiles for the rows' bucket (`CANDIDATES`) against
the scaled matmul (x quantized by `fp8_quant` in both), each a CUDA graph of the layer's four
products replayed (do_bench_cudagraph: no launch gaps, as in the engine's decode graphs; the
layer's 109 MB of FP8 weights exceed the 50 MB L2, so each product reads its weights from
memory), with each candidate's largest difference from the scaled matmul's output (relative
to its largest entry), then the best tile a bucket. With `--blocked`: 128 x 128 block scales,
the table's tile against `fp8_gemm` (W8A16, the dispatch's block-scaled path; x not quantized
there, so the difference includes x's e4m3 rounding).

ms per decoder layer (the four products, medians of triton.testing.do_bench, which clears L2
before each run), with the weight-read limit at the device's copy bandwidth (measured here)
and the compute limit at the bf16 matmul rate measured here (FP8 tensor cores: twice it).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from triton.testing import do_bench, do_bench_cudagraph

from pdserve.engine.models import fp8
from pdserve.kernels.fp8_gemm import fp8_gemm
from pdserve.kernels.fp8_quant import quantize_per_token
from pdserve.kernels.fp8_w8a8 import CANDIDATES, MAX_ROWS, Tile, tile_for, w8a8_linear

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # (N, K) of one 8B layer


def _torch_quant_scaled_mm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    x_scale = (x.abs().amax(dim=1, keepdim=True).float() / 448.0).clamp(min=torch.finfo(torch.float32).tiny)
    x_fp8 = (x.float() / x_scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return torch._scaled_mm(x_fp8, w.t(), scale_a=x_scale, scale_b=scale.reshape(1, -1), out_dtype=x.dtype)


def _fused_quant_scaled_mm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                           fast_accum: bool = False) -> torch.Tensor:
    x_fp8, x_scale = quantize_per_token(x)
    return torch._scaled_mm(x_fp8, w.t(), scale_a=x_scale, scale_b=scale.reshape(1, -1), out_dtype=x.dtype,
                            use_fast_accum=fast_accum)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128, 256, 512, 2048, 4096])
    parser.add_argument("--sweep", action="store_true", help="time fp8_w8a8's candidate tiles instead")
    parser.add_argument("--sweep-rows", type=int, nargs="+", default=[2, 8, 16, 32, 64, 128, 256, 512])
    parser.add_argument("--blocked", action="store_true",
                        help="with --sweep: 128 x 128 block scales, the table's tile against fp8_gemm (W8A16)")
    args = parser.parse_args()
    if any(not 1 <= m <= MAX_ROWS for m in args.sweep_rows):
        parser.error(f"--sweep-rows must lie in 1-{MAX_ROWS}, got {args.sweep_rows}")
    layers = []
    for n, k in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q, s = fp8.quantize_per_channel(w)
        layers.append((w, q, s.float()))
    src = torch.empty(1 << 29, device="cuda", dtype=torch.bfloat16)
    copy_bw = 2 * src.nbytes / do_bench(lambda: src.clone(), return_mode="median") / 1e-3
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_rate = 2 * 8192 ** 3 / do_bench(lambda: a @ a, return_mode="median") / 1e-3
    bf16_bytes = sum(w.nbytes for w, _, _ in layers)
    params = sum(w.numel() for w, _, _ in layers)
    print(f"{torch.cuda.get_device_name()}: copy {copy_bw / 1e12:.2f} TB/s, bf16 matmul {mm_rate / 1e12:.0f} "
          f"TFLOP/s; one layer's weights {bf16_bytes / 1e6:.0f} MB bf16")

    def limit_fp8(m: int) -> float:
        return max(bf16_bytes / 2 / copy_bw, 2 * m * params / (2 * mm_rate)) * 1e3

    if args.sweep:
        _sweep(args.sweep_rows, layers, limit_fp8, args.blocked)
        return
    variants = {
        "bf16": lambda x, w, q, s: F.linear(x, w),
        "fp8 dispatch": lambda x, w, q, s: fp8.linear(x, q, s, None, False),
        "scaled_mm, torch quant": lambda x, w, q, s: _torch_quant_scaled_mm(x, q, s),
        "scaled_mm, fused quant": lambda x, w, q, s: _fused_quant_scaled_mm(x, q, s),
        "fast accum": lambda x, w, q, s: _fused_quant_scaled_mm(x, q, s, fast_accum=True),
        "fp8_gemm": lambda x, w, q, s: fp8_gemm(x, q, s, None),
        "w8a8": lambda x, w, q, s: fp8.linear(x, q, s, None, False, w8a8=True),
    }
    print("| rows | " + " | ".join(variants) + " | limit bf16 | limit fp8 |")
    print("|---:|" + "---:|" * (len(variants) + 2))
    for m in args.rows:
        xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _, k in SHAPES]
        cells = []
        for name, fn in variants.items():
            if name in ("fp8_gemm", "w8a8") and m > MAX_ROWS:
                cells.append("-")
                continue
            ms = sum(do_bench(lambda x=x, layer=layer: fn(x, *layer), return_mode="median")
                     for x, layer in zip(xs, layers))
            cells.append(f"{ms:.3f}")
        lim16 = max(bf16_bytes / copy_bw, 2 * m * params / mm_rate) * 1e3
        print(f"| {m} | " + " | ".join(cells) + f" | {lim16:.3f} | {limit_fp8(m):.3f} |", flush=True)


def _graph_ms(products: list) -> float:
    """Median ms of the layer's products replayed as one CUDA graph."""
    def layer() -> None:
        for product in products:
            product()
    return do_bench_cudagraph(layer, return_mode="median")


def _block_scaled(layers: list) -> list:
    """The layers with 128 x 128 block scales (each block's largest row scale) for the sweep's
    --blocked timings: both kernels then multiply the same dequantized weights."""
    return [(w, q, s.view(-1, 128).amax(1, keepdim=True).expand(-1, q.shape[1] // 128).contiguous())
            for w, q, s in layers]


def _sweep(rows: list[int], layers: list, limit_fp8, blocked: bool) -> None:
    if blocked:  # against the dispatch's block-scaled path today, fp8_gemm (W8A16: x not quantized)
        layers = _block_scaled(layers)
        baseline, name, bound = (lambda x, q, s: fp8_gemm(x, q, s, None, blocked=True)), "fp8_gemm", 1e-1
    else:
        baseline, name, bound = _fused_quant_scaled_mm, "scaled_mm", 2e-2
    best = []
    print(f"| rows | tile | ms per layer | {name} ms | speedup | % of limit | max diff |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for m in rows:
        xs = [torch.randn(m, w.shape[1], device="cuda", dtype=torch.bfloat16) for w, _, _ in layers]
        refs = [baseline(x, q, s) for x, (_, q, s) in zip(xs, layers)]
        base = _graph_ms([lambda x=x, q=q, s=s: baseline(x, q, s) for x, (_, q, s) in zip(xs, layers)])
        tiles = (tile_for(m),) if blocked else CANDIDATES[min(upper for upper in CANDIDATES if upper >= m)]
        timed: list[tuple[float, Tile]] = []
        for tile in tiles:
            try:
                outs = [w8a8_linear(x, q, s, blocked=blocked, tile=tile) for x, (_, q, s) in zip(xs, layers)]
                diff = max(((o.float() - r.float()).abs().max() / r.float().abs().max()).item()
                           for o, r in zip(outs, refs))
                ms = _graph_ms([lambda x=x, q=q, s=s, t=tile: w8a8_linear(x, q, s, blocked=blocked, tile=t)
                                for x, (_, q, s) in zip(xs, layers)])
            except Exception as exc:  # a tile the card refuses (resources): a row saying so
                print(f"| {m} | {tile.describe()} | failed: {type(exc).__name__}: {str(exc)[:80]} | | | | |")
                continue
            if diff <= bound:  # a wrong tile is shown, never chosen
                timed.append((ms, tile))
            print(f"| {m} | {tile.describe()} | {ms:.3f} | {base:.3f} | {base / ms:.2f}x | "
                  f"{100 * limit_fp8(m) / ms:.0f}% | {diff:.1e}{' WRONG' if diff > bound else ''} |", flush=True)
        if timed:
            best.append((m, base, *min(timed, key=lambda t: t[0])))
    _print_best(best, name, blocked, limit_fp8)


def _print_best(best: list, name: str, blocked: bool, limit_fp8) -> None:
    scales = "128 x 128 block scales" if blocked else "per-channel scales"
    print(f"\nBest tile per row count, {scales} ({name}: the dispatch's path today, x quantized by fp8_quant "
          "for scaled_mm; limit = the FP8 weight read or the FP8 matmul at twice the bf16 rate, whichever is longer):")
    print(f"| rows | {name} ms | best tile | ms | speedup | limit ms | % of limit |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for m, base, ms, tile in best:
        print(f"| {m} | {base:.3f} | {tile.describe()} | {ms:.3f} | {base / ms:.2f}x | {limit_fp8(m):.3f} | "
              f"{100 * limit_fp8(m) / ms:.0f}% |")


if __name__ == "__main__":
    main()
