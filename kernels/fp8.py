"""The FP8 KV cache's number format: e4m3 (`torch.float8_e4m3fn`, Triton's `float8e4nv`),
4 exponent bits and 3 mantissa bits, finite up to +-448, no infinities.

K and V are stored without a scale (vLLM's default of k_scale = v_scale = 1): a value is
rounded to the nearest e4m3 number (ties to even) and saturated at +-448. Attention
kernels widen what they load to the query's dtype before their dots, or, in paged decode's
opt-in FP8-dot mode, quantize the query (`quantize_rows`) and multiply e4m3 by e4m3.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KV_FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0


@triton.jit
def to_e4m3(x):
    """x (float32) rounded to nearest-even on the e4m3 grid, saturated at +-448, as float8e4nv.

    The rounding is float32 arithmetic, so the final cast only converts an exact value: the
    GPU's cvt does the same rounding, but Triton 3.6's interpreter rounds a carry into the
    exponent wrongly (7.97 -> 4) and ties away from even, and the kernels' CPU tests run
    there. Spacing of the grid at |x|: 2**(exponent - 3) for normal numbers (exponent >= -6),
    2**-9 below; x / spacing < 16, where adding and subtracting 1.5 * 2**23 rounds to an
    integer, ties to even.
    """
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    exponent = tl.maximum(((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6) - 3
    down = ((127 - exponent) << 23).to(tl.float32, bitcast=True)  # 2 ** -exponent
    up = ((127 + exponent) << 23).to(tl.float32, bitcast=True)
    steps = (x * down + 12582912.0) - 12582912.0
    return (steps * up).to(tl.float8e4nv)


@triton.jit
def quantize_rows(x):
    """x [R, D] as e4m3 rows and their float32 scales [R]: row r is to_e4m3(x[r] / scale[r])
    with scale[r] = max|x[r]| / 448, so that no entry saturates and the largest lands on the
    grid's top; a row of zeros (padding) gets scale 1.

    The query of paged decode's FP8-dot mode. FlashAttention-3 takes descale factors per
    (sequence, KV head) and vLLM a calibrated q_scale per tensor or per head (1.0 without
    calibration, which saturates any query entry past 448); a scale per row, computed where
    the query is loaded, needs no calibration and costs one row maximum per program.
    """
    x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), 1)
    scale = tl.where(amax > 0, amax / 448.0, 1.0)
    return to_e4m3(x / scale[:, None]), scale


@triton.jit
def to_cache(x, cache_ptr):
    """x in the dtype of the cache behind cache_ptr: rounded to e4m3 for an FP8 cache."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        return to_e4m3(x.to(tl.float32))
    else:
        return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def dot_dtype(q, k):
    """q in the dtype attention's dots run in beside a K tile k: q's own, but float16 beside
    an FP8 cache when q is bfloat16 (e4m3 widens to float16 in one conversion, to bfloat16
    through float32: at 256 x 1.5k that made paged decode compute-bound at half the
    bandwidth; e4m3 is exact in either, and a query past float16's range, 65504, saturates)."""
    if k.dtype == tl.float8e4nv and q.dtype == tl.bfloat16:
        return tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    else:
        return q


def check_cache_dtype(model_dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    """A KV cache holds the model's dtype, or e4m3 beside a floating model dtype."""
    assert cache_dtype == model_dtype or (cache_dtype == KV_FP8 and model_dtype in (
        torch.float16, torch.bfloat16, torch.float32)), (model_dtype, cache_dtype)


def quantize(x: torch.Tensor) -> torch.Tensor:
    """x as an FP8 cache holds it, in torch (the CPU path, and the kernels' reference):
    saturated at +-448, rounded to nearest-even."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(KV_FP8)
