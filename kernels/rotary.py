"""Rotary position embedding of q and k in place (the neox / Hugging Face "rotate_half"
convention: a head's first half rotates against its second)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    x_ptr, token, stride_t, stride_h,
    cos1, sin1, cos2, sin2,  # [BLOCK_D] float32: the table rows' first and second halves
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HALF)
    first = x_ptr + token * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1).
    out1 = x1 * cos1[None, :] - x2 * sin1[None, :]
    out2 = x2 * cos2[None, :] + x1 * sin2[None, :]
    tl.store(first, out1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, out2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,          # [num_tokens, num_q_heads, head_dim], last dim contiguous
    k_ptr,          # [num_tokens, num_kv_heads, head_dim], last dim contiguous
    positions_ptr,  # [num_tokens] int32/int64
    cos_ptr, sin_ptr,  # [max_positions, head_dim] float32, contiguous
    stride_qt, stride_qh, stride_kt, stride_kh,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = HEAD_DIM // 2
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HALF
    table = pos * HEAD_DIM + offs_d
    cos1 = tl.load(cos_ptr + table, mask=mask_d, other=0.0)
    sin1 = tl.load(sin_ptr + table, mask=mask_d, other=0.0)
    cos2 = tl.load(cos_ptr + table + HALF, mask=mask_d, other=0.0)
    sin2 = tl.load(sin_ptr + table + HALF, mask=mask_d, other=0.0)
    _rotate_heads(q_ptr, token, stride_qt, stride_qh, cos1, sin1, cos2, sin2,
                  NUM_Q_HEADS, HALF, BLOCK_HQ, BLOCK_D)
    _rotate_heads(k_ptr, token, stride_kt, stride_kh, cos1, sin1, cos2, sin2,
                  NUM_KV_HEADS, HALF, BLOCK_HK, BLOCK_D)


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """Rotate q and k in place by their tokens' positions: x * cos + rotate_half(x) * sin,
    in fp32, rounded once to the dtype.

    Args:
        q: [num_tokens, num_q_heads, head_dim]; k: [num_tokens, num_kv_heads, head_dim];
            same dtype, may be strided views (of a fused qkv output, say) as long as the
            last dim is contiguous. head_dim even.
        positions: [num_tokens] int32 or int64, contiguous; each < max_positions (not
            checked: that would sync).
        cos, sin: [max_positions, head_dim] float32, contiguous (engine/models/rope.py's
            tables, whose two halves are equal).

    No host sync and no allocation: safe to capture in a CUDA graph.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == (num_tokens, num_kv_heads, head_dim), (k.shape, q.shape)
    assert head_dim % 2 == 0, head_dim
    assert q.dtype == k.dtype, (q.dtype, k.dtype)
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "last dim of q/k must be contiguous"
    assert positions.shape == (num_tokens,) and positions.dtype in (torch.int32, torch.int64), positions.dtype
    assert positions.is_contiguous()
    assert cos.shape == sin.shape and cos.dim() == 2 and cos.shape[1] == head_dim, (cos.shape, sin.shape)
    assert cos.dtype == sin.dtype == torch.float32, cos.dtype
    assert cos.is_contiguous() and sin.is_contiguous()
    if num_tokens == 0:
        return
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim // 2),
        num_warps=4,
    )
