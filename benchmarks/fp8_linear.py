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
- fp8_gemm: the Triton W8A16 kernel (x unquantized).

    python -m benchmarks.fp8_linear [--rows 1 16 64 256 512 4096]

ms per decoder layer (the four products, medians of triton.testing.do_bench, which clears L2
before each run), with the weight-read limit at the device's copy bandwidth (measured here)
and the compute limit at the bf16 matmul rate measured here (FP8 tensor cores: twice it).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from pdserve.engine.models import fp8
from pdserve.kernels.fp8_gemm import fp8_gemm
from pdserve.kernels.fp8_quant import quantize_per_token

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
    args = parser.parse_args()
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
    variants = {
        "bf16": lambda x, w, q, s: F.linear(x, w),
        "fp8 dispatch": lambda x, w, q, s: fp8.linear(x, q, s, None, False),
        "scaled_mm, torch quant": lambda x, w, q, s: _torch_quant_scaled_mm(x, q, s),
        "scaled_mm, fused quant": lambda x, w, q, s: _fused_quant_scaled_mm(x, q, s),
        "fast accum": lambda x, w, q, s: _fused_quant_scaled_mm(x, q, s, fast_accum=True),
        "fp8_gemm": lambda x, w, q, s: fp8_gemm(x, q, s, None),
    }
    print("| rows | " + " | ".join(variants) + " | limit bf16 | limit fp8 |")
    print("|---:|" + "---:|" * (len(variants) + 2))
    for m in args.rows:
        xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _, k in SHAPES]
        cells = []
        for name, fn in variants.items():
            if name == "fp8_gemm" and m > 512:
                cells.append("-")
                continue
            ms = sum(do_bench(lambda x=x, layer=layer: fn(x, *layer), return_mode="median")
                     for x, layer in zip(xs, layers))
            cells.append(f"{ms:.3f}")
        flops = 2 * m * params
        lim16 = max(bf16_bytes / copy_bw, flops / mm_rate) * 1e3
        lim8 = max(bf16_bytes / 2 / copy_bw, flops / (2 * mm_rate)) * 1e3
        print(f"| {m} | " + " | ".join(cells) + f" | {lim16:.3f} | {lim8:.3f} |", flush=True)


if __name__ == "__main__":
    main()
