"""flash_prefill against the float64 reference: ragged batches, earlier context in the
cache, GQA, block sizes, strided q. CPU runs tiny shapes in the interpreter; `gpu` ones
run full size on the device."""

from __future__ import annotations

import itertools

import pytest
import torch

from kernels import flash_prefill
from tests.kernels.reference import make_paged_kv, ref_paged_attention, rel_error, tolerance

COVERS = ("flash_prefill",)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _check_prefill(
    q_lens: list[int], context_lens: list[int], num_q_heads: int, num_kv_heads: int, head_dim: int,
    block_size: int, dtype: torch.dtype, strided_q: bool = False, **tuning: int,
) -> None:
    seq_lens = [c + n for c, n in zip(context_lens, q_lens)]
    kv = make_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, dtype, DEVICE)
    num_tokens = sum(q_lens)
    if strided_q:  # q as a view of a fused qkv projection output
        qkv = torch.randn(num_tokens, num_q_heads + 2 * num_kv_heads, head_dim, device=DEVICE).to(dtype)
        q = qkv[:, :num_q_heads]
    else:
        q = torch.randn(num_tokens, num_q_heads, head_dim, device=DEVICE).to(dtype)
    cu_seqlens_q = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=DEVICE)
    out = torch.full((num_tokens, num_q_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    scale = head_dim ** -0.5
    got = flash_prefill(q, kv.k_cache, kv.v_cache, cu_seqlens_q, kv.seq_lens, kv.block_tables, scale,
                        max(q_lens), out=out, **tuning)
    assert got is out
    ref = ref_paged_attention(q, kv, q_lens, scale)
    err = rel_error(out, ref)
    assert err < tolerance(dtype), err


# (q_lens, context_lens): lengths around a 16-token tile/block edge, ragged batches, and
# chunked prefill / prefix hits whose earlier context is already in the cache.
CPU_SHAPES = [
    ([1], [0]), ([15], [0]), ([16], [0]), ([17], [0]),
    ([1, 15, 16, 17], [0, 0, 0, 0]),
    ([5, 17, 1], [20, 3, 40]),
]


@pytest.mark.parametrize("q_lens,context_lens", CPU_SHAPES)
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (4, 1), (8, 1)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_shapes(q_lens, context_lens, num_q_heads, num_kv_heads, block_size, dtype):
    _check_prefill(q_lens, context_lens, num_q_heads, num_kv_heads, 64, block_size, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_strided_q(dtype):
    _check_prefill([17, 3], [33, 0], 4, 2, 64, 16, dtype, strided_q=True)


def test_prefill_head_dim_128_and_wide_tiles():
    _check_prefill([20, 9], [13, 40], 2, 1, 128, 16, torch.float32, block_m=32, block_n=32)


def test_prefill_allocates_out():
    kv = make_paged_kv([4], 1, 64, 16, torch.float32, DEVICE)
    q = torch.randn(4, 2, 64, device=DEVICE)
    cu = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)
    out = flash_prefill(q, kv.k_cache, kv.v_cache, cu, kv.seq_lens, kv.block_tables, 0.125, 4)
    assert rel_error(out, ref_paged_attention(q, kv, [4], 0.125)) < 1e-4


GPU_DTYPES_BLOCK_SIZES = [(torch.bfloat16, 16), (torch.bfloat16, 32), (torch.float16, 16), (torch.float32, 32)]
GPU_SHAPES = [
    ([1, 15, 16, 17, 1000], [0, 0, 0, 0, 0]),
    ([3000, 1, 129], [0, 2047, 4000]),
    ([512, 700], [1536, 9]),
]


@pytest.mark.gpu
@pytest.mark.parametrize("q_lens,context_lens", GPU_SHAPES)
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(8, 8), (32, 8), (16, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype,block_size", GPU_DTYPES_BLOCK_SIZES)
def test_prefill_gpu(q_lens, context_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype):
    _check_prefill(q_lens, context_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype,
                   strided_q=True)


@pytest.mark.gpu
@pytest.mark.parametrize("block_m,block_n,num_warps,num_stages",
                         [(64, 64, 4, 2), (128, 128, 8, 2), (128, 32, 4, 4), (256, 64, 8, 3), (128, 64, 4, 3)])
def test_prefill_gpu_tunings(block_m, block_n, num_warps, num_stages):
    _check_prefill([1, 777, 2048], [0, 100, 3], 32, 8, 128, 16, torch.bfloat16,
                   block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
