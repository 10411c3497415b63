"""A step's new latents into a paged latent (MLA) cache: one program a token writes its row
[c_kv | k_pe] (k_pe already rotated) at its slot, in the cache's dtype (rounded to e4m3
for an FP8 cache, as `fp8.quantize` rounds), and a negative slot (a padded token of a
CUDA-graph batch) writes nothing. torch's index_copy_ cannot skip such a slot: on CUDA an
index of -1 is a device-side assert, and the graphs of `engine/runner/cuda_graphs.py` pad
every batch to its bucket with them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels import fp8


@triton.jit
def _write_latents_kernel(cache_ptr, slot_ptr, c_ptr, pe_ptr, stride_c, stride_pe,
                          RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_P: tl.constexpr):
    token = tl.program_id(0)
    # int64: slot * row size overflows int32 for pools past 2**31 elements.
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        row = cache_ptr + slot * (RANK + ROPE)
        offs_r = tl.arange(0, BLOCK_R)
        c = tl.load(c_ptr + token * stride_c + offs_r, mask=offs_r < RANK)
        tl.store(row + offs_r, fp8.to_cache(c, cache_ptr), mask=offs_r < RANK)
        offs_p = tl.arange(0, BLOCK_P)
        pe = tl.load(pe_ptr + token * stride_pe + offs_p, mask=offs_p < ROPE)
        tl.store(row + RANK + offs_p, fp8.to_cache(pe, cache_ptr), mask=offs_p < ROPE)


def write_latents(cache: torch.Tensor, slot_mapping: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor) -> None:
    """Write each token's latent [kv_c | k_pe] into its slot of one layer's cache.

    Args:
        cache: [num_blocks, block_size, kv_lora_rank + rope_dim] contiguous (`KVPool.latent`),
            the model's dtype or float8_e4m3fn.
        slot_mapping: [num_tokens] int32 or int64, block_id * block_size + offset; negative:
            not written (padding).
        kv_c: [num_tokens, kv_lora_rank], k_pe: [num_tokens, rope_dim]; last dims contiguous.
    """
    num_tokens, rank = kv_c.shape
    rope = k_pe.shape[1]
    assert cache.is_contiguous() and cache.dim() == 3 and cache.shape[2] == rank + rope, (
        f"cache [num_blocks, block_size, {rank} + {rope}], got {tuple(cache.shape)}")
    assert k_pe.shape[0] == num_tokens and slot_mapping.shape == (num_tokens,), (
        kv_c.shape, k_pe.shape, slot_mapping.shape)
    assert slot_mapping.dtype in (torch.int32, torch.int64)
    assert kv_c.stride(1) == 1 and k_pe.stride(1) == 1
    fp8.check_cache_dtype(kv_c.dtype, cache.dtype)
    if num_tokens == 0:
        return
    _write_latents_kernel[(num_tokens,)](
        cache, slot_mapping, kv_c, k_pe, kv_c.stride(0), k_pe.stride(0), RANK=rank, ROPE=rope,
        BLOCK_R=triton.next_power_of_2(rank), BLOCK_P=triton.next_power_of_2(rope), num_warps=4)
