"""The FP8 (e4m3) cache format: `quantize` (torch) saturates at +-448 and rounds to
nearest-even; the kernels' own rounding (`fp8.to_e4m3`, which the cache write uses) gives
the same value for every bfloat16 input, on the GPU and in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from pdserve.kernels import fp8
from pdserve.kernels.fp8 import check_cache_dtype, quantize

COVERS = ("check_cache_dtype", "quantize")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _round_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, fp8.to_e4m3(tl.load(x_ptr + offs, mask=mask).to(tl.float32)), mask=mask)


def test_quantize_saturates_and_rounds_to_even():
    x = torch.tensor([1000.0, -1000.0, 448.0, 464.0, 7.97, -84.0, 88.0, 1.0625, 1.1875, 2.0 ** -10, float("nan")])
    got = quantize(x).float()
    # 464 is past the largest finite (448); -84 and 1.0625 are ties (even: -80, 1.0); 1.1875 rounds up;
    # 2**-10 is half the smallest subnormal (2**-9): a tie, to 0.
    want = torch.tensor([448.0, -448.0, 448.0, 448.0, 8.0, -80.0, 88.0, 1.0, 1.25, 0.0, float("nan")])
    assert torch.equal(got.nan_to_num(-1.0), want.nan_to_num(-1.0)), got


def test_kernel_rounding_matches_quantize_for_every_bfloat16():
    bits = torch.arange(-(2 ** 15), 2 ** 15, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16)
    x = x[x.isfinite()].to(DEVICE)
    out = torch.empty(x.shape, dtype=fp8.KV_FP8, device=DEVICE)
    block = 1024
    _round_kernel[(triton.cdiv(x.numel(), block),)](x, out, x.numel(), BLOCK=block)
    want = quantize(x)
    # As values: the interpreter drops the sign of a negative number that rounds to zero.
    mismatch = out.float() != want.float()
    assert not mismatch.any(), (x[mismatch][:8], out[mismatch][:8], want[mismatch][:8])


def test_check_cache_dtype():
    check_cache_dtype(torch.bfloat16, torch.bfloat16)
    check_cache_dtype(torch.bfloat16, fp8.KV_FP8)
    check_cache_dtype(torch.float32, fp8.KV_FP8)
    with pytest.raises(AssertionError):
        check_cache_dtype(torch.bfloat16, torch.float16)
