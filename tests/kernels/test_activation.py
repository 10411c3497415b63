"""silu_and_mul against the float64 reference: sizes across the column block, strided
gate_up rows and a strided preallocated output whose NaN padding must stay untouched."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.activation import silu_and_mul
from tests.kernels.reference import ref_silu_and_mul, rounding_tolerance

COVERS = ("silu_and_mul",)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAD = 5  # NaN columns after each row of gate_up and of a given out


def _check_silu_and_mul(num_tokens: int, inter: int, dtype: torch.dtype, given_out: bool) -> None:
    gate_up_buf = torch.full((num_tokens, 2 * inter + PAD), float("nan"), dtype=dtype, device=DEVICE)
    gate_up = gate_up_buf[:, :2 * inter]
    gate_up.copy_(4 * torch.randn(num_tokens, 2 * inter, device=DEVICE))
    ref = ref_silu_and_mul(gate_up)
    out_buf = torch.full((num_tokens, inter + PAD), float("nan"), dtype=dtype, device=DEVICE)
    if given_out:
        out = silu_and_mul(gate_up, out=out_buf[:, :inter])
        assert out.data_ptr() == out_buf.data_ptr()
        assert out_buf[:, inter:].isnan().all()
    else:
        out = silu_and_mul(gate_up)
        assert out.is_contiguous() and out.dtype == dtype
    assert out.shape == (num_tokens, inter)
    torch.testing.assert_close(out.double(), ref, **rounding_tolerance(dtype))
    assert gate_up_buf[:, 2 * inter:].isnan().all()


@pytest.mark.parametrize("num_tokens", [1, 6])
@pytest.mark.parametrize("inter", [64, 100, 1536])  # 1536: two column blocks, the second partial
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("given_out", [False, True])
def test_silu_and_mul(num_tokens, inter, dtype, given_out):
    _check_silu_and_mul(num_tokens, inter, dtype, given_out)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # the interpreter's numpy
def test_silu_and_mul_extremes():
    # Large |gate|: exp overflows to inf for very negative gates, the product must be 0 not NaN.
    gate = torch.tensor([[-100.0, -20.0, 0.0, 20.0, 100.0]], device=DEVICE)
    gate_up = torch.cat((gate, torch.full_like(gate, 2.0)), dim=1)
    out = silu_and_mul(gate_up)
    torch.testing.assert_close(out.double(), ref_silu_and_mul(gate_up), rtol=1e-6, atol=1e-6)


def test_silu_and_mul_no_tokens():
    assert silu_and_mul(torch.empty(0, 128, device=DEVICE)).shape == (0, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 8192])
@pytest.mark.parametrize("inter", [14336, 1536])  # Llama-3.1-8B, SmolLM2-135M
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_silu_and_mul_gpu(num_tokens, inter, dtype):
    _check_silu_and_mul(num_tokens, inter, dtype, given_out=True)
