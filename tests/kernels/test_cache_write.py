"""cache_write against the reference scatter: strided key/value, int32/int64 slots,
negative (padding) slots skipped."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import cache_write
from tests.kernels.reference import ref_cache_write

COVERS = ("cache_write",)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _check_cache_write(num_tokens: int, num_kv_heads: int, head_dim: int, block_size: int,
                       dtype: torch.dtype, slot_dtype: torch.dtype, num_blocks: int = 4) -> None:
    # key and value as strided views of one fused qkv output (2 query heads in front).
    qkv = torch.randn(num_tokens, 2 + 2 * num_kv_heads, head_dim, device=DEVICE).to(dtype)
    key, value = qkv[:, 2:2 + num_kv_heads], qkv[:, 2 + num_kv_heads:]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens].to(slot_dtype)
    slots[::3] = -1  # padding tokens
    k_ref, v_ref = ref_cache_write(key, value, k_cache, v_cache, slots)
    cache_write(key, value, k_cache, v_cache, slots)
    # equal_nan: untouched slots must keep their NaN poison, written ones match exactly.
    assert torch.allclose(k_cache, k_ref, rtol=0, atol=0, equal_nan=True)
    assert torch.allclose(v_cache, v_ref, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("num_tokens", [1, 17, 40])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 64), (2, 128), (3, 64)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_cache_write(num_tokens, num_kv_heads, head_dim, block_size, dtype, slot_dtype):
    _check_cache_write(num_tokens, num_kv_heads, head_dim, block_size, dtype, slot_dtype)


def test_cache_write_no_tokens():
    k_cache = torch.zeros(1, 16, 1, 64, device=DEVICE)
    empty = torch.empty(0, 1, 64, device=DEVICE)
    cache_write(empty, empty, k_cache, k_cache.clone(), torch.empty(0, dtype=torch.int32, device=DEVICE))
    assert not k_cache.any()


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 8192])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(8, 128), (3, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cache_write_gpu(num_tokens, num_kv_heads, head_dim, dtype):
    _check_cache_write(num_tokens, num_kv_heads, head_dim, 16, dtype, torch.int64, num_blocks=1024)
