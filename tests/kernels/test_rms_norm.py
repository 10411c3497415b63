"""rms_norm against the torch model's math: power-of-2 and other hidden sizes, strided
rows whose NaN padding must stay untouched, with and without the fused residual add
(both written in place)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.rms_norm import rms_norm
from tests.kernels.reference import ref_rms_norm, rounding_tolerance

COVERS = ("rms_norm",)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5
PAD = 7  # NaN columns after each row of x and residual


def _padded(num_tokens: int, hidden: int, dtype: torch.dtype, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer [num_tokens, hidden + PAD] with NaN padding, its [num_tokens, hidden] view of random values)."""
    buf = torch.full((num_tokens, hidden + PAD), float("nan"), dtype=dtype, device=DEVICE)
    view = buf[:, :hidden]
    view.copy_(scale * torch.randn(num_tokens, hidden, device=DEVICE))
    return buf, view


def _check_rms_norm(num_tokens: int, hidden: int, dtype: torch.dtype, with_residual: bool) -> None:
    x_buf, x = _padded(num_tokens, hidden, dtype, scale=3.0)
    r_buf, residual = _padded(num_tokens, hidden, dtype, scale=1.0)
    weight = (1 + 0.5 * torch.randn(hidden, device=DEVICE)).to(dtype)
    ref_out, ref_sum = ref_rms_norm(x.clone(), weight, EPS, residual.clone() if with_residual else None)
    x_before = x_buf.clone()
    # Two roundings (normalised, then scaled by the weight) where the reference rounds the
    # same values: one of them may fall on the other side.
    tol = rounding_tolerance(dtype, roundings=2)

    if with_residual:
        out = rms_norm(x, weight, EPS, residual)
        assert out is x
        # The sum is rounded to the dtype from the same fp32 sum: exact.
        torch.testing.assert_close(residual, ref_sum, rtol=0, atol=0)
        torch.testing.assert_close(x, ref_out, **tol)
    else:
        out = rms_norm(x, weight, EPS)
        assert out.is_contiguous() and out.shape == x.shape and out.dtype == dtype
        torch.testing.assert_close(out, ref_out, **tol)
        torch.testing.assert_close(x_buf, x_before, rtol=0, atol=0, equal_nan=True)
    assert x_buf[:, hidden:].isnan().all() and r_buf[:, hidden:].isnan().all()


@pytest.mark.parametrize("num_tokens", [1, 5, 17])
@pytest.mark.parametrize("hidden", [64, 100, 576])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(num_tokens, hidden, dtype, with_residual):
    _check_rms_norm(num_tokens, hidden, dtype, with_residual)


def test_rms_norm_contiguous_input():
    x = torch.randn(3, 128, device=DEVICE)
    weight = torch.randn(128, device=DEVICE)
    torch.testing.assert_close(rms_norm(x, weight, EPS), ref_rms_norm(x, weight, EPS)[0], rtol=1e-5, atol=1e-5)


def test_rms_norm_no_tokens():
    x = torch.empty(0, 64, device=DEVICE)
    weight = torch.ones(64, device=DEVICE)
    assert rms_norm(x, weight, EPS).shape == (0, 64)
    assert rms_norm(x, weight, EPS, torch.empty(0, 64, device=DEVICE)) is x


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 8192])
@pytest.mark.parametrize("hidden", [4096, 576])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_gpu(num_tokens, hidden, dtype, with_residual):
    _check_rms_norm(num_tokens, hidden, dtype, with_residual)
