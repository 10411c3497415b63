"""fp8_gemm (x times FP8 weights with per-channel or 128 x 128 block scales, plus a bias)
against the float64 product of x and the dequantized weights: 1-16 rows (the decode path)
and more, shapes that fill the tiles and shapes that do not (masked rows, columns and a
partial scale block), strided x and weight rows; float16 and float32 x in the interpreter,
bfloat16 on the GPU (the interpreter keeps bfloat16 as raw bits)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.fp8_gemm import FP8, SCALE_BLOCK, fp8_gemm

COVERS = ("fp8_gemm",)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weights(n: int, k: int, blocked: bool, pad: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w = (torch.randn(n, k + pad, generator=gen) * 100).clamp(-448, 448).to(FP8)[:, :k]
    shape = (-(-n // SCALE_BLOCK), -(-k // SCALE_BLOCK)) if blocked else (n, 1)
    return w, torch.rand(shape, generator=gen) * 0.01 + 1e-3


def _dequantized(w: torch.Tensor, scale: torch.Tensor, blocked: bool) -> torch.Tensor:
    if not blocked:
        return w.double() * scale.double()
    full = scale.double().repeat_interleave(SCALE_BLOCK, 0).repeat_interleave(SCALE_BLOCK, 1)
    return w.double() * full[:w.shape[0], :w.shape[1]]


def _check(m: int, n: int, k: int, dtype: torch.dtype, blocked: bool, with_bias: bool, pad: int = 0) -> None:
    gen = torch.Generator().manual_seed(m * 31 + n * 7919 + k)
    w, scale = _weights(n, k, blocked, pad, gen)
    x = torch.randn(m, k + pad, generator=gen).to(dtype)[:, :k]
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    ref = x.double() @ _dequantized(w, scale, blocked).T + (bias.double() if bias is not None else 0)
    out = fp8_gemm(x.to(DEVICE), w.to(DEVICE), scale.to(DEVICE), bias.to(DEVICE) if bias is not None else None,
                   blocked=blocked)
    assert out.shape == (m, n) and out.dtype == dtype
    # float32 accumulation over k products of exact operands, then one rounding to the dtype.
    size = (x.double().abs() @ _dequantized(w, scale, blocked).abs().T).max().item()
    atol = size * (k * 2 * torch.finfo(torch.float32).eps + torch.finfo(dtype).eps)
    torch.testing.assert_close(out.cpu().double(), ref, rtol=torch.finfo(dtype).eps, atol=atol)


@pytest.mark.parametrize("m, n, k", [(1, 64, 128), (3, 50, 200), (16, 128, 256), (20, 72, 130)])
@pytest.mark.parametrize("blocked", [False, True])
def test_fp8_gemm_matches_the_dequantized_product(m, n, k, blocked):
    _check(m, n, k, torch.float16, blocked, with_bias=m % 2 == 1)


@pytest.mark.parametrize("blocked", [False, True])
def test_fp8_gemm_float32_x_with_bias_and_strided_rows(blocked):
    _check(5, 136, 264, torch.float32, blocked, with_bias=True, pad=24)


def test_fp8_gemm_a_row_past_one_row_tile():
    """17 rows: two row tiles (of 64), the second holding one row; 65 columns: a second column tile."""
    _check(17, 65, 64, torch.float32, blocked=False, with_bias=False)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 16, 64])
@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
@pytest.mark.parametrize("blocked", [False, True])
def test_fp8_gemm_at_the_8b_shapes(m, n, k, blocked):
    _check(m, n, k, torch.bfloat16, blocked, with_bias=False)
