"""gemv (one row of x times W.T, plus a bias) against the float64 product: shapes that fill
its blocks and shapes that do not (masked rows and columns), both configurations (K below
and above 8192), bias or none, strided weight rows; the result is rounded once. FP8 weights
with per-row and 128 x 128 block scales against the product of the dequantized weights."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.gemv import _TUNED, gemv

COVERS = ("gemv",)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Under the interpreter (no GPU) big shapes are slow: the K >= 8192 configuration gets one small N.
SHAPES = [(8, 256), (24, 512), (50, 300), (3, 17), (40, 8192 + 96)]


def _check(n: int, k: int, dtype: torch.dtype, with_bias: bool, pad: int, read_ahead: bool = False) -> None:
    gen = torch.Generator().manual_seed(n * 7919 + k)
    w_buf = torch.randn(n, k + pad, generator=gen).to(dtype)
    w = w_buf.to(DEVICE)[:, :k]  # rows `pad` elements apart
    x = torch.randn(1, k, generator=gen).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if with_bias else None
    ref = x.double() @ w.double().T + (bias.double() if bias is not None else 0)
    out = gemv(x, w, bias, read_ahead=read_ahead)
    assert out.shape == (1, n) and out.dtype == dtype
    # float32 accumulation over k products, then one rounding to the dtype.
    scale = (x.double().abs() @ w.double().abs().T).max().item()
    atol = scale * (k * 2 * torch.finfo(torch.float32).eps + torch.finfo(dtype).eps)
    torch.testing.assert_close(out.double(), ref, rtol=torch.finfo(dtype).eps, atol=atol)


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_the_product(n, k, dtype, with_bias):
    _check(n, k, dtype, with_bias, pad=0)


def test_gemv_reads_strided_weight_rows():
    _check(40, 300, torch.float32, with_bias=True, pad=13)


@pytest.mark.parametrize("n, k", [(24, 512), (50, 300)])
def test_gemv_read_ahead(n, k):
    """The engine's launch: the first weight tile read before the PDL wait."""
    _check(n, k, torch.float32, with_bias=True, pad=0, read_ahead=True)


def test_gemv_float32_weights_beside_a_bfloat16_row_give_float32():
    """DeepSeek's router: x bfloat16, the weight float32, the logits float32 as
    x.float() @ weight.T (x widened as read, nothing rounded to bfloat16 on the way)."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(64, 320, generator=gen)
    x = torch.randn(1, 320, generator=gen).to(torch.bfloat16)
    out = gemv(x.to(DEVICE), w.to(DEVICE), read_ahead=True, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    ref = x.double() @ w.double().T
    atol = (x.double().abs() @ w.double().abs().T).max().item() * 320 * 2 * torch.finfo(torch.float32).eps
    torch.testing.assert_close(out.cpu().double(), ref, rtol=0, atol=atol)
    # One bfloat16 rounding of the output would be ~100x that.
    assert (out.cpu().double() - ref).abs().max() < 1e-4 * ref.abs().max()


def _check_fp8(n: int, k: int, blocked: bool, read_ahead: bool, dtype: torch.dtype = torch.float32) -> None:
    """FP8 weights with per-row or 128 x 128 block scales against the float64 product of x and
    the dequantized weights."""
    gen = torch.Generator().manual_seed(n * 31 + k)
    w = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    shape = (-(-n // 128), -(-k // 128)) if blocked else (n, 1)
    scale = torch.rand(shape, generator=gen) * 0.01 + 1e-3
    full = scale.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k] if blocked else scale.double()
    deq = w.double() * full
    x = torch.randn(1, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    ref = x.double() @ deq.T + bias.double()
    out = gemv(x.to(DEVICE), w.to(DEVICE), bias.to(DEVICE), read_ahead=read_ahead, scale=scale.to(DEVICE),
               blocked=blocked)
    assert out.shape == (1, n) and out.dtype == dtype
    size = (x.double().abs() @ deq.abs().T).max().item()
    atol = size * (k * 2 * torch.finfo(torch.float32).eps + torch.finfo(dtype).eps)
    torch.testing.assert_close(out.cpu().double(), ref, rtol=torch.finfo(dtype).eps, atol=atol)


@pytest.mark.parametrize("n, k", [(24, 512), (50, 300), (3, 17)])
@pytest.mark.parametrize("blocked", [False, True])
def test_gemv_fp8_weights_match_the_dequantized_product(n, k, blocked):
    _check_fp8(n, k, blocked, read_ahead=n == 24)


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
@pytest.mark.parametrize("blocked", [False, True])
def test_gemv_fp8_at_the_8b_shapes(n, k, blocked):
    _check_fp8(n, k, blocked, read_ahead=True, dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", sorted({(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096),
                                          *_TUNED}))
def test_gemv_at_the_8b_and_1b_shapes(n, k):
    _check(n, k, torch.bfloat16, with_bias=False, pad=0)
