"""SwiGLU's activation: silu(gate) * up over the fused gate/up projection's output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels import _pdl

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,  # [num_tokens, 2 * inter], last dim contiguous: gate columns, then up
    out_ptr,      # [num_tokens, inter], last dim contiguous
    stride_in, stride_out, inter,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    _pdl.wait(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    row = gate_up_ptr + token * stride_in
    gate = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + inter + offs, mask=mask, other=0.0).to(tl.float32)
    # x / (1 + exp(-x)) is torch's silu; the product is rounded once, not twice.
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + token * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up, computed in fp32 and rounded once to the dtype.

    Args:
        gate_up: [num_tokens, 2 * inter], last dim contiguous; gate is the first half of
            each row, up the second.
        out: optional [num_tokens, inter], last dim contiguous, gate_up's dtype; a new
            contiguous tensor when None.

    Returns:
        out.

    No host sync and no allocation beyond the output: safe to capture in a CUDA graph.
    """
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0, gate_up.shape
    assert gate_up.stride(-1) == 1, "last dim of gate_up must be contiguous"
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty((num_tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
    assert out.shape == (num_tokens, inter) and out.dtype == gate_up.dtype, (out.shape, out.dtype)
    assert out.stride(-1) == 1, "last dim of out must be contiguous"
    if num_tokens == 0:
        return out
    pdl = _pdl.pdl(gate_up)
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, _BLOCK))](
        gate_up, out, gate_up.stride(0), out.stride(0), inter,
        BLOCK=_BLOCK, PDL=pdl, num_warps=4, launch_pdl=pdl,
    )
    return out
