"""flash_prefill against the float64 reference: ragged batches, earlier context in the
cache, GQA, block sizes, strided q, and the new tokens' K/V read from the cache or given
contiguously (k_new/v_new). CPU runs tiny shapes in the interpreter; `gpu` ones run full
size on the device."""

from __future__ import annotations

import itertools

import pytest
import torch

from pdserve.kernels.flash_prefill import flash_prefill
from pdserve.kernels.fp8 import KV_FP8
from tests.kernels.reference import PagedKV, make_paged_kv, ref_paged_attention, rel_error, slot_mapping, tolerance

COVERS = ("flash_prefill",)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _split_new_kv(
    kv: PagedKV, q_lens: list[int], context_lens: list[int], fused: bool, dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The new tokens' K/V taken out of the cache, in dtype (q's), packed like q (as views of one fused
    [num_tokens, 2, kv_heads, dim] buffer when `fused`); their cache slots then hold NaN,
    so a kernel that still reads them there fails."""
    block_size, num_kv_heads, head_dim = kv.k_cache.shape[1:]
    slots = torch.tensor([s for b, (c, n) in enumerate(zip(context_lens, q_lens))
                          for s in slot_mapping(kv.block_tables.cpu(), b, range(c, c + n), block_size)],
                         device=kv.k_cache.device)
    k_flat, v_flat = kv.k_cache.view(-1, num_kv_heads, head_dim), kv.v_cache.view(-1, num_kv_heads, head_dim)
    if fused:
        kv_new = torch.stack([k_flat[slots].to(dtype), v_flat[slots].to(dtype)], dim=1)
        k_new, v_new = kv_new[:, 0], kv_new[:, 1]
    else:
        k_new, v_new = k_flat[slots].to(dtype), v_flat[slots].to(dtype)
    if k_flat.dtype == KV_FP8:  # e4m3's NaN, as bytes (torch has no float8 index_put on the CPU)
        k_flat.view(torch.uint8)[slots] = 0x7F
        v_flat.view(torch.uint8)[slots] = 0x7F
    else:
        k_flat[slots] = float("nan")
        v_flat[slots] = float("nan")
    return k_new, v_new


def _check_prefill(
    q_lens: list[int], context_lens: list[int], num_q_heads: int, num_kv_heads: int, head_dim: int,
    block_size: int, dtype: torch.dtype, strided_q: bool = False, new_kv: bool = False,
    cache_dtype: torch.dtype | None = None, **tuning: int,
) -> None:
    seq_lens = [c + n for c, n in zip(context_lens, q_lens)]
    kv = make_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, dtype, DEVICE, cache_dtype=cache_dtype)
    num_tokens = sum(q_lens)
    if strided_q:  # q as a view of a fused qkv projection output
        qkv = torch.randn(num_tokens, num_q_heads + 2 * num_kv_heads, head_dim, device=DEVICE).to(dtype)
        q = qkv[:, :num_q_heads]
    else:
        q = torch.randn(num_tokens, num_q_heads, head_dim, device=DEVICE).to(dtype)
    cu_seqlens_q = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=DEVICE)
    out = torch.full((num_tokens, num_q_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    scale = head_dim ** -0.5
    ref = ref_paged_attention(q, kv, q_lens, scale)
    k_new = v_new = None
    if new_kv:
        k_new, v_new = _split_new_kv(kv, q_lens, context_lens, fused=strided_q, dtype=dtype)
    got = flash_prefill(q, kv.k_cache, kv.v_cache, cu_seqlens_q, kv.seq_lens, kv.block_tables, scale,
                        max(q_lens), out=out, k_new=k_new, v_new=v_new, **tuning)
    assert got is out
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
@pytest.mark.parametrize("new_kv", [False, True])
def test_prefill_shapes(q_lens, context_lens, num_q_heads, num_kv_heads, block_size, dtype, new_kv):
    _check_prefill(q_lens, context_lens, num_q_heads, num_kv_heads, 64, block_size, dtype, new_kv=new_kv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("new_kv", [False, True])
def test_prefill_strided_q(dtype, new_kv):
    _check_prefill([17, 3], [33, 0], 4, 2, 64, 16, dtype, strided_q=True, new_kv=new_kv)


@pytest.mark.parametrize("new_kv", [False, True])
def test_prefill_head_dim_128_and_wide_tiles(new_kv):
    _check_prefill([20, 9], [13, 40], 2, 1, 128, 16, torch.float32, new_kv=new_kv, block_m=32, block_n=32)


def test_prefill_new_kv_tile_wider_than_queries():
    # K/V tiles wider than the query tile: the diagonal tile starts left of the queries'.
    _check_prefill([40, 7], [5, 0], 2, 1, 64, 16, torch.float32, new_kv=True, block_m=16, block_n=32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("new_kv", [False, True])
def test_prefill_fp8_cache(dtype, new_kv):
    """Earlier context from an FP8 cache, widened to q's dtype; the new tokens' K/V from the
    cache too, or given in q's dtype."""
    _check_prefill([5, 17, 1], [20, 3, 40], 4, 2, 64, 16, dtype, new_kv=new_kv, cache_dtype=KV_FP8)


def test_prefill_new_kv_needs_both():
    kv = make_paged_kv([4], 1, 64, 16, torch.float32, DEVICE)
    q = torch.randn(4, 2, 64, device=DEVICE)
    cu = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)
    with pytest.raises(AssertionError, match="both"):
        flash_prefill(q, kv.k_cache, kv.v_cache, cu, kv.seq_lens, kv.block_tables, 0.125, 4,
                      k_new=torch.randn(4, 1, 64, device=DEVICE))


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
@pytest.mark.parametrize("new_kv", [False, True])
def test_prefill_gpu(q_lens, context_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, new_kv):
    _check_prefill(q_lens, context_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype,
                   strided_q=True, new_kv=new_kv)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("new_kv", [False, True])
def test_prefill_gpu_long(head_dim, dtype, new_kv):
    # max_seqlen_q >= 4096 switches the default tiles.
    _check_prefill([4500, 3, 300], [0, 5000, 17], 16, 4, head_dim, 16, dtype, strided_q=True, new_kv=new_kv)


@pytest.mark.gpu
@pytest.mark.parametrize("new_kv", [False, True])
def test_prefill_gpu_head_dim_256_at_16_bits_fits_hopper(new_kv):
    """Rows of 512 bytes: the sweep's tiles of 8k (and, with k_new/v_new, 4k) queries asked a
    Hopper program for 262,400 (459,776) bytes of shared memory; the defaults fit them."""
    _check_prefill([8200, 3], [0, 300], 8, 2, 256, 16, torch.bfloat16, strided_q=True, new_kv=new_kv)


@pytest.mark.gpu
@pytest.mark.parametrize("block_m,block_n,num_warps,num_stages",
                         [(64, 64, 4, 2), (128, 128, 8, 2), (128, 32, 4, 4), (256, 64, 8, 3), (128, 64, 4, 3)])
def test_prefill_gpu_tunings(block_m, block_n, num_warps, num_stages):
    _check_prefill([1, 777, 2048], [0, 100, 3], 32, 8, 128, 16, torch.bfloat16,
                   block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages)


# The k_new/v_new (TMA) path's tunings, the benchmark sweep's among them.
NEW_KV_GPU_TUNINGS = [  # block_m, block_n, num_warps, num_stages, maxnreg
    (64, 64, 4, 3, 0), (128, 128, 8, 3, 0), (128, 64, 8, 2, 0), (128, 64, 8, 2, 128), (128, 32, 8, 3, 128),
    (64, 32, 4, 3, 0), (128, 64, 8, 4, 0), (128, 128, 8, 2, 0),
]


@pytest.mark.gpu
@pytest.mark.parametrize("block_m,block_n,num_warps,num_stages,maxnreg", NEW_KV_GPU_TUNINGS)
def test_prefill_gpu_new_kv_tunings(block_m, block_n, num_warps, num_stages, maxnreg):
    _check_prefill([1, 777, 2048], [0, 100, 3], 32, 8, 128, 16, torch.bfloat16, strided_q=True, new_kv=True,
                   block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                   maxnreg=maxnreg)


@pytest.mark.gpu
@pytest.mark.parametrize("q_lens,context_lens", GPU_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("new_kv", [False, True])
def test_prefill_gpu_fp8_cache(q_lens, context_lens, dtype, new_kv):
    _check_prefill(q_lens, context_lens, 32, 8, 128, 16, dtype, strided_q=True, new_kv=new_kv, cache_dtype=KV_FP8)
