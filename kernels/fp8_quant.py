"""x quantized to e4m3 per token (row): each row's amax / 448 its scale, in one kernel.

What cuBLASLt's row-wise scaled FP8 matmul takes as its left operand (engine.models.fp8):
one program per row reads the row twice (its amax, then the quantized values; the second
read hits L2), writes one byte an element and one float32 scale, where the same in torch
ops was eight kernels over float32 copies of x. The rounding is `kernels.fp8.to_e4m3`'s
(nearest-even, float32 arithmetic) and the divisions are IEEE's (`tl.div_rn`; Triton's `/`
is the GPU's approximate one), so the bytes are torch's, in the interpreter and on the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.fp8 import KV_FP8, to_e4m3

_BLOCK = 4096  # elements of a row per loop step
_TINY = torch.finfo(torch.float32).tiny  # the scale of an all-zero row: its values stay 0


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, tiny,
                          BLOCK: tl.constexpr, ONE_PASS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    if ONE_PASS:  # the whole row in registers
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.div_rn(tl.max(tl.abs(x), 0), 448.0), tiny)
        tl.store(q_ptr + row * stride_q + cols, to_e4m3(tl.div_rn(x, scale)), mask=cols < K)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            x = tl.load(x_ptr + row * stride_x + k0 + cols, mask=k0 + cols < K, other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        scale = tl.maximum(tl.div_rn(tl.max(amax, 0), 448.0), tiny)
        for k0 in range(0, K, BLOCK):
            x = tl.load(x_ptr + row * stride_x + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
            tl.store(q_ptr + row * stride_q + k0 + cols, to_e4m3(tl.div_rn(x, scale)), mask=k0 + cols < K)
    tl.store(s_ptr + row, scale)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (float32, float16 or bfloat16; columns contiguous) -> (x_fp8 [M, K] e4m3,
    scale [M, 1] float32) with x ~= x_fp8 * scale, each row's largest |value| at 448."""
    assert x.dim() == 2 and x.stride(-1) == 1 and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
    m, k = x.shape
    q = torch.empty(m, k, dtype=KV_FP8, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        one_pass = k <= _BLOCK
        block = triton.next_power_of_2(k) if one_pass else _BLOCK
        _quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), _TINY, BLOCK=block,
                                    ONE_PASS=one_pass, num_warps=8 if block >= 2048 else 4)
    return q, scale

