"""RMSNorm of each token's hidden state, optionally fused with the residual add before it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels import _pdl


@triton.jit
def _rms_norm_kernel(
    x_ptr,         # [num_tokens, hidden], last dim contiguous
    residual_ptr,  # [num_tokens, hidden], last dim contiguous; unused without HAS_RESIDUAL
    weight_ptr,    # [hidden]
    out_ptr,       # [num_tokens, hidden], last dim contiguous; x itself with HAS_RESIDUAL
    stride_x, stride_r, stride_out,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    _pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The sum is rounded to the model dtype before the norm reads it, as the unfused
        # `x + residual` followed by a norm would.
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * stride_r + offs, x, mask=mask)
    xf = x.to(tl.float32)
    mean_square = tl.sum(xf * xf, axis=0) / hidden
    # Normalised in fp32, rounded to the model dtype, then scaled (one more rounding):
    # the same two steps as the torch module (and transformers).
    normed = (xf * tl.rsqrt(mean_square + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """weight * normalize(x), each row normalized by its root mean square in fp32.

    Args:
        x: [num_tokens, hidden], last dim contiguous (rows may be strided).
        weight: [hidden], contiguous, x's dtype.
        eps: added to the mean square before the reciprocal square root.
        residual: optional [num_tokens, hidden], last dim contiguous, x's dtype. When
            given, the add before the norm is fused in (vLLM's fused_add_rms_norm):
            s = x + residual (rounded to the dtype) overwrites `residual`, norm(s)
            overwrites `x`, and `x` is returned.

    Returns:
        Without residual a new contiguous [num_tokens, hidden] tensor; with it, `x`.

    No host sync and no allocation beyond the output: safe to capture in a CUDA graph.
    """
    assert x.dim() == 2, x.shape
    num_tokens, hidden = x.shape
    assert weight.shape == (hidden,) and weight.is_contiguous(), weight.shape
    assert weight.dtype == x.dtype, (weight.dtype, x.dtype)
    assert x.stride(-1) == 1, "last dim of x must be contiguous"
    if residual is None:
        out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    else:
        assert residual.shape == x.shape and residual.dtype == x.dtype, (residual.shape, residual.dtype)
        assert residual.stride(-1) == 1, "last dim of residual must be contiguous"
        out = x
    if num_tokens == 0:
        return out
    block = triton.next_power_of_2(hidden)
    r = x if residual is None else residual  # a placeholder pointer without residual
    pdl = _pdl.pdl(x)
    _rms_norm_kernel[(num_tokens,)](
        x, r, weight, out,
        x.stride(0), r.stride(0), out.stride(0),
        hidden, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, PDL=pdl, launch_pdl=pdl,
        # ~16 elements per thread: 8 warps for hidden 4096, 2 for 576.
        num_warps=min(max(block // 512, 1), 16),
    )
    return out
