"""A step's new latents into a paged latent (MLA) cache, rotated on the way: one program a
token rotates its k_pe by its position (the rotate-half convention, `kernels.rotary`'s) and
writes its row [c_kv | k_pe] at its slot, in the cache's dtype (rounded to e4m3 for an FP8
cache, as `fp8.quantize` rounds), and rotates the token's query rope part q_pe in place by
the same table row: one launch a layer where torch's rotation and row write took about
fifteen, which at one token a step cost more than their work. A negative slot (a padded
token of a CUDA-graph batch) writes nothing: torch's index_copy_ cannot skip it (on CUDA an
index of -1 is a device-side assert), and the graphs of `engine/runner/cuda_graphs.py` pad
every batch to its bucket with them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels import fp8
from pdserve.kernels.rotary import _rotate_heads


@triton.jit
def _write_latents_kernel(cache_ptr, slot_ptr, c_ptr, pe_ptr, q_ptr, positions_ptr, cos_ptr, sin_ptr,
                          stride_c, stride_pe, stride_qt, stride_qh,
                          RANK: tl.constexpr, ROPE: tl.constexpr, NUM_HEADS: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, ROTATE: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = ROPE // 2
    # int64: slot * row size overflows int32 for pools past 2**31 elements.
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HALF
    k1 = tl.load(pe_ptr + token * stride_pe + offs_d, mask=mask_d, other=0.0)
    k2 = tl.load(pe_ptr + token * stride_pe + HALF + offs_d, mask=mask_d, other=0.0)
    if ROTATE:
        table = tl.load(positions_ptr + token).to(tl.int64) * ROPE + offs_d
        cos1 = tl.load(cos_ptr + table, mask=mask_d, other=0.0)
        sin1 = tl.load(sin_ptr + table, mask=mask_d, other=0.0)
        cos2 = tl.load(cos_ptr + table + HALF, mask=mask_d, other=0.0)
        sin2 = tl.load(sin_ptr + table + HALF, mask=mask_d, other=0.0)
        _rotate_heads(q_ptr, token, stride_qt, stride_qh, cos1, sin1, cos2, sin2, q_ptr, slot, q_ptr, 0.0,
                      NUM_HEADS, HALF, BLOCK_H, BLOCK_D, False, False)
        x1, x2 = k1.to(tl.float32), k2.to(tl.float32)
        # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1), rounded to k_pe's dtype
        # (the query's) as the torch rotation rounds, then to the cache's.
        k1 = (x1 * cos1 - x2 * sin1).to(pe_ptr.dtype.element_ty)
        k2 = (x2 * cos2 + x1 * sin2).to(pe_ptr.dtype.element_ty)
    if slot >= 0:
        row = cache_ptr + slot * (RANK + ROPE)
        offs_r = tl.arange(0, BLOCK_R)
        c = tl.load(c_ptr + token * stride_c + offs_r, mask=offs_r < RANK)
        tl.store(row + offs_r, fp8.to_cache(c, cache_ptr), mask=offs_r < RANK)
        tl.store(row + RANK + offs_d, fp8.to_cache(k1, cache_ptr), mask=mask_d)
        tl.store(row + RANK + HALF + offs_d, fp8.to_cache(k2, cache_ptr), mask=mask_d)


def write_latents(cache: torch.Tensor, slot_mapping: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                  rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """Write each token's latent [kv_c | k_pe] into its slot of one layer's cache.

    Args:
        cache: [num_blocks, block_size, kv_lora_rank + rope_dim] contiguous (`KVPool.latent`),
            the model's dtype or float8_e4m3fn.
        slot_mapping: [num_tokens] int32 or int64, block_id * block_size + offset; negative:
            not written (padding).
        kv_c: [num_tokens, kv_lora_rank], k_pe: [num_tokens, rope_dim] (rope_dim even); last
            dims contiguous.
        rope: None (k_pe written as it is), or (q_pe, positions, cos, sin): k_pe is rotated by
            its token's row of the tables before it is written, and q_pe [num_tokens, heads,
            rope_dim] (a view, last dim contiguous: the rope part of the step's queries)
            rotated in place by the same row. positions [num_tokens] int32/int64; cos, sin
            [max_positions, rope_dim] float32 contiguous (both halves equal, `RotaryEmbedding`).
    """
    num_tokens, rank = kv_c.shape
    rope_dim = k_pe.shape[1]
    assert cache.is_contiguous() and cache.dim() == 3 and cache.shape[2] == rank + rope_dim, (
        f"cache [num_blocks, block_size, {rank} + {rope_dim}], got {tuple(cache.shape)}")
    assert k_pe.shape[0] == num_tokens and slot_mapping.shape == (num_tokens,), (
        kv_c.shape, k_pe.shape, slot_mapping.shape)
    assert slot_mapping.dtype in (torch.int32, torch.int64) and rope_dim % 2 == 0
    assert kv_c.stride(1) == 1 and k_pe.stride(1) == 1
    fp8.check_cache_dtype(kv_c.dtype, cache.dtype)
    q_pe, positions, cos, sin = rope if rope is not None else (k_pe.unsqueeze(1), slot_mapping, k_pe, k_pe)
    if rope is not None:
        assert q_pe.shape[0] == num_tokens and q_pe.shape[2] == rope_dim and q_pe.stride(2) == 1, q_pe.shape
        assert positions.shape == (num_tokens,) and positions.dtype in (torch.int32, torch.int64)
        assert cos.shape == sin.shape and cos.shape[1] == rope_dim and cos.is_contiguous() and sin.is_contiguous()
        assert cos.dtype == sin.dtype == torch.float32
    if num_tokens == 0:
        return
    _write_latents_kernel[(num_tokens,)](
        cache, slot_mapping, kv_c, k_pe, q_pe, positions, cos, sin, kv_c.stride(0), k_pe.stride(0),
        q_pe.stride(0), q_pe.stride(1), RANK=rank, ROPE=rope_dim, NUM_HEADS=q_pe.shape[1],
        BLOCK_R=triton.next_power_of_2(rank), BLOCK_D=triton.next_power_of_2(rope_dim // 2),
        BLOCK_H=triton.next_power_of_2(q_pe.shape[1]), ROTATE=rope is not None, num_warps=4)
