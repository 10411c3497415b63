"""quantize_per_token against torch's per-row amax / 448 and e4m3 cast: the same scales and
the same bytes, one pass (a row in registers) and two (rows longer than a loop step), strided
rows, a zero row, values at the saturation edge; float16/float32 in the interpreter, bfloat16
too on the GPU (the interpreter keeps bfloat16 as raw bits)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.fp8 import E4M3_MAX, KV_FP8
from pdserve.kernels.fp8_quant import quantize_per_token

COVERS = ("quantize_per_token",)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (x.abs().amax(dim=1, keepdim=True).float() / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(KV_FP8), scale


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, k", [(1, 64), (5, 1000), (3, 4096), (2, 4097), (3, 14336)])
def test_the_bytes_and_scales_are_torchs(dtype, m, k):
    gen = torch.Generator().manual_seed(m * 7 + k)
    x = (torch.randn(m, k + 3, generator=gen) * torch.logspace(-3, 3, m).unsqueeze(1)).to(dtype)[:, :k]
    x[0, 0] = 0.0
    q, scale = quantize_per_token(x.to(DEVICE))
    want_q, want_scale = _reference(x)
    assert q.dtype == KV_FP8 and q.shape == (m, k) and scale.shape == (m, 1)
    torch.testing.assert_close(scale.cpu(), want_scale, rtol=0, atol=0)
    assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8))
    assert (q.float().abs().amax(dim=1) == E4M3_MAX).all()  # each row's largest value at the edge


def test_a_zero_row_and_no_rows():
    q, scale = quantize_per_token(torch.zeros(2, 300, device=DEVICE))
    assert (q.float() == 0).all() and (scale > 0).all()
    q, scale = quantize_per_token(torch.zeros(0, 300, device=DEVICE))
    assert q.shape == (0, 300) and scale.shape == (0, 1)
