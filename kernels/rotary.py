"""A step's new q and k rotated in place by their positions (the neox / Hugging Face
"rotate_half" convention: a head's first half rotates against its second), and the rotated
k with v written into the paged KV cache (in its dtype: the model's, or FP8), in one kernel:
the two were two launches per layer, and at one token each launch costs more than its work.
For a family that RMS-normalizes each q and k head before the rotation (Qwen3), the norms
too: they were four more launches a layer (two norms, two copies of the strided heads)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels import _pdl, fp8


@triton.jit
def _rotate_heads(
    x_ptr, token, stride_t, stride_h,
    cos1, sin1, cos2, sin2,  # [BLOCK_D] float32: the table rows' first and second halves
    cache_ptr, slot,  # with WRITE: the rotated rows are also stored at this slot of the cache
    norm_ptr, eps,  # with NORM: each head RMS-normalized by this [2 * HALF] weight first
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    WRITE: tl.constexpr, NORM: tl.constexpr,
):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HALF)
    first = x_ptr + token * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        # The torch module's two roundings (layers.RMSNorm, as transformers'): normalized in
        # fp32 and rounded to the dtype, then scaled by the weight and rounded again.
        mean_square = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)
        inv = tl.rsqrt(mean_square + eps)[:, None]
        dtype = x_ptr.dtype.element_ty
        w1 = tl.load(norm_ptr + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(norm_ptr + HALF + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)[None, :]
        x1 = (w1 * (x1 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1).
    out1 = (x1 * cos1[None, :] - x2 * sin1[None, :]).to(x_ptr.dtype.element_ty)
    out2 = (x2 * cos2[None, :] + x1 * sin2[None, :]).to(x_ptr.dtype.element_ty)
    if WRITE:
        dst = cache_ptr + slot * (NUM_HEADS * 2 * HALF) + offs_h[:, None] * (2 * HALF) + offs_d[None, :]
        c1, c2 = fp8.to_cache(out1, cache_ptr), fp8.to_cache(out2, cache_ptr)
        tl.store(dst, c1, mask=mask)
        tl.store(dst + HALF, c2, mask=mask)
        # The step attends what the cache holds: an FP8 cache's rounding, in place too.
        out1, out2 = c1.to(x_ptr.dtype.element_ty), c2.to(x_ptr.dtype.element_ty)
    tl.store(first, out1, mask=mask)
    tl.store(first + HALF, out2, mask=mask)


@triton.jit
def _rotary_cache_write_kernel(
    q_ptr,          # [num_tokens, num_q_heads, head_dim], last dim contiguous
    k_ptr,          # [num_tokens, num_kv_heads, head_dim], last dim contiguous
    v_ptr,          # [num_tokens, num_kv_heads, head_dim], last dim contiguous
    positions_ptr,  # [num_tokens] int32/int64
    cos_ptr, sin_ptr,  # [max_positions, head_dim] float32, contiguous
    k_cache_ptr, v_cache_ptr,  # [num_blocks * block_size, num_kv_heads, head_dim], contiguous
    slot_ptr,       # [num_tokens] int32/int64; negative = padding, not written
    q_norm_ptr, k_norm_ptr, eps,  # [head_dim] each: the heads' RMSNorm weights, with NORM
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
    READ_AHEAD: tl.constexpr, NORM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = HEAD_DIM // 2
    # With READ_AHEAD the positions, slots and tables are read while the kernel before this
    # one finishes; q, k, v after it has.
    if not READ_AHEAD:
        _pdl.wait(PDL)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    # int64: slot * row size overflows int32 for pools past 2**31 elements.
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HALF
    table = pos * HEAD_DIM + offs_d
    cos1 = tl.load(cos_ptr + table, mask=mask_d, other=0.0)
    sin1 = tl.load(sin_ptr + table, mask=mask_d, other=0.0)
    cos2 = tl.load(cos_ptr + table + HALF, mask=mask_d, other=0.0)
    sin2 = tl.load(sin_ptr + table + HALF, mask=mask_d, other=0.0)
    if READ_AHEAD:
        _pdl.wait(PDL)
    _rotate_heads(q_ptr, token, stride_qt, stride_qh, cos1, sin1, cos2, sin2, q_ptr, slot, q_norm_ptr, eps,
                  NUM_Q_HEADS, HALF, BLOCK_HQ, BLOCK_D, False, NORM)
    # A padding token is rotated but not written: a branch, not the scalar folded into the
    # mask (that keeps the mask a block of bools, which Triton 3.x's interpreter needs).
    if slot >= 0:
        _rotate_heads(k_ptr, token, stride_kt, stride_kh, cos1, sin1, cos2, sin2, k_cache_ptr, slot, k_norm_ptr,
                      eps, NUM_KV_HEADS, HALF, BLOCK_HK, BLOCK_D, True, NORM)
        offs_h = tl.arange(0, BLOCK_HK)
        mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HALF)
        src = v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
        dst = v_cache_ptr + slot * (NUM_KV_HEADS * HEAD_DIM) + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
        v1 = fp8.to_cache(tl.load(src, mask=mask), v_cache_ptr)
        v2 = fp8.to_cache(tl.load(src + HALF, mask=mask), v_cache_ptr)
        tl.store(dst, v1, mask=mask)
        tl.store(dst + HALF, v2, mask=mask)
        if v_cache_ptr.dtype.element_ty != v_ptr.dtype.element_ty:
            tl.store(src, v1.to(v_ptr.dtype.element_ty), mask=mask)
            tl.store(src + HALF, v2.to(v_ptr.dtype.element_ty), mask=mask)
    else:
        _rotate_heads(k_ptr, token, stride_kt, stride_kh, cos1, sin1, cos2, sin2, k_cache_ptr, slot, k_norm_ptr,
                      eps, NUM_KV_HEADS, HALF, BLOCK_HK, BLOCK_D, False, NORM)


def rotary_cache_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    read_ahead: bool = False,
    head_norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> None:
    """Rotate q and k in place by their tokens' positions (x * cos + rotate_half(x) * sin,
    in fp32, rounded once to the dtype), and write each token's rotated k and its v into
    its slot of the paged cache. With an FP8 cache, each written token's k and v are left
    in place as the cache holds them (rounded to e4m3, in their dtype), so that attention
    over the step's own k, v (a fresh prompt's) sees the values every later step reads.

    Args:
        q: [num_tokens, num_q_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim];
            same dtype, may be strided views (of a fused qkv output, say) as long as the
            last dim is contiguous. head_dim even.
        positions: [num_tokens] int32 or int64, contiguous; each < max_positions (not
            checked: that would sync).
        cos, sin: [max_positions, head_dim] float32, contiguous (engine/models/rope.py's
            tables, whose two halves are equal).
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous,
            q's dtype, or float8_e4m3fn (an FP8 cache: k and v rounded to it, `kernels.fp8`).
        slot_mapping: [num_tokens] int32 or int64; slot = block_id * block_size + offset.
            A negative slot (a padded token of a CUDA-graph batch) is rotated, not written.
        read_ahead: positions, slots and tables were final before the kernel preceding this
            one started (the engine's step inputs): read them before waiting for it
            (`kernels._pdl`).
        head_norms: (q weight, k weight, eps): RMS-normalize each q and k head first, the
            weights [head_dim] contiguous in q's dtype (Qwen3's q_norm and k_norm), as
            `rms_norm` of each head would (its two roundings), before the rotation.

    No host sync and no allocation: safe to capture in a CUDA graph.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim), (q.shape, k.shape, v.shape)
    assert head_dim % 2 == 0, head_dim
    assert q.dtype == k.dtype == v.dtype and k_cache.dtype == v_cache.dtype, (q.dtype, k.dtype, v.dtype)
    fp8.check_cache_dtype(q.dtype, k_cache.dtype)
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1, "last dim of q/k/v must be contiguous"
    assert positions.shape == (num_tokens,) and positions.dtype in (torch.int32, torch.int64), positions.dtype
    assert positions.is_contiguous()
    assert cos.shape == sin.shape and cos.dim() == 2 and cos.shape[1] == head_dim, (cos.shape, sin.shape)
    assert cos.dtype == sin.dtype == torch.float32, cos.dtype
    assert cos.is_contiguous() and sin.is_contiguous()
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (num_kv_heads, head_dim), k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype in (torch.int32, torch.int64)
    q_norm, k_norm, eps = head_norms if head_norms is not None else (q, q, 0.0)  # placeholders without
    if head_norms is not None:
        for w in (q_norm, k_norm):
            assert w.shape == (head_dim,) and w.is_contiguous() and w.dtype == q.dtype, (w.shape, w.dtype)
    if num_tokens == 0:
        return
    pdl = _pdl.pdl(q)
    _rotary_cache_write_kernel[(num_tokens,)](
        q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping, q_norm, k_norm, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim // 2), PDL=pdl, READ_AHEAD=read_ahead, NORM=head_norms is not None,
        num_warps=4, launch_pdl=pdl,
    )
