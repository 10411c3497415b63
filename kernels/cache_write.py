"""Scatter new tokens' K and V into the paged KV cache through a slot mapping."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _cache_write_kernel(
    key_ptr, value_ptr,          # [num_tokens, num_kv_heads, head_dim], last dim contiguous
    k_cache_ptr, v_cache_ptr,    # [num_blocks * block_size, num_kv_heads, head_dim], contiguous
    slot_ptr,                    # [num_tokens] int32/int64; negative = padding, skip
    stride_kt, stride_kh, stride_vt, stride_vh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    # int64: slot * row size overflows int32 for pools past 2**31 elements.
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # A padding token is skipped by a branch, not by folding the scalar into the mask:
    # besides loading nothing, that keeps the mask a block of bools (Triton 3.9's
    # interpreter makes `bool block & bool scalar` an int32 block and refuses it as a mask).
    if slot >= 0:
        mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
        src_k = key_ptr + token.to(tl.int64) * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
        src_v = value_ptr + token.to(tl.int64) * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
        dst = slot * (NUM_KV_HEADS * HEAD_DIM) + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(k_cache_ptr + dst, tl.load(src_k, mask=mask), mask=mask)
        tl.store(v_cache_ptr + dst, tl.load(src_v, mask=mask), mask=mask)


def cache_write(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's K/V row into its slot of the paged cache.

    Args:
        key, value: [num_tokens, num_kv_heads, head_dim]; may be strided views (of a fused
            qkv output, say) as long as the last dim is contiguous.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous,
            same dtype as key/value.
        slot_mapping: [num_tokens] int32 or int64; slot = block_id * block_size + offset.
            Negative slots are skipped (padded tokens of a CUDA-graph batch).

    No host sync and no allocation: safe to capture in a CUDA graph.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, (value.shape, key.shape)
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (num_kv_heads, head_dim), k_cache.shape
    assert key.dtype == value.dtype == k_cache.dtype == v_cache.dtype, (key.dtype, k_cache.dtype)
    assert key.stride(-1) == 1 and value.stride(-1) == 1, "last dim of key/value must be contiguous"
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype in (torch.int32, torch.int64)
    if num_tokens == 0:
        return
    _cache_write_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
    )
