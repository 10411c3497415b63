"""paged_verify against the float64 reference: a few new tokens per sequence after its
context (speculative verification), GQA, block sizes 16/32, split-K with splits that
start past some tokens' positions (rows that see no key of a split), one-token and empty
chunks, fp32/fp16/bf16. Outputs start as NaN so an unwritten row fails; blocks no
sequence owns hold NaN so a read outside a sequence fails."""

from __future__ import annotations

import itertools

import pytest
import torch

from pdserve.kernels.fp8 import KV_FP8
from pdserve.kernels.paged_decode import paged_verify, paged_verify_fits
from tests.kernels.reference import make_paged_kv, ref_paged_attention, rel_error, tolerance

COVERS = ("paged_verify", "paged_verify_fits")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _check_verify(
    chunks: list[tuple[int, int]], num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
    dtype: torch.dtype, cache_dtype: torch.dtype | None = None, **launch: int,
) -> None:
    """chunks: (new tokens, earlier context) per sequence."""
    q_lens = [n for n, _ in chunks]
    kv = make_paged_kv([n + c for n, c in chunks], num_kv_heads, head_dim, block_size, dtype, DEVICE,
                       cache_dtype=cache_dtype)
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, device=DEVICE).to(dtype)
    cu_seqlens = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    scale = head_dim ** -0.5
    got = paged_verify(q, kv.k_cache, kv.v_cache, cu_seqlens, kv.seq_lens, kv.block_tables, scale, max(q_lens),
                       out=out, **launch)
    assert got is out
    want = ref_paged_attention(q, kv, q_lens, scale)
    assert rel_error(out, want) < tolerance(dtype)
    for b, (start, n) in enumerate(zip(cu_seqlens.tolist(), q_lens)):  # no short one hides behind a long one
        if n:
            assert rel_error(out[start:start + n], want[start:start + n]) < tolerance(dtype), (b, chunks[b])


@pytest.mark.parametrize("chunks", [[(5, 20)], [(1, 0)], [(3, 13), (5, 0), (1, 40), (4, 16)], [(0, 7), (2, 30)]])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (4, 1)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_verify_shapes(chunks, num_q_heads, num_kv_heads, block_size):
    _check_verify(chunks, num_q_heads, num_kv_heads, 64, block_size, torch.float32, num_splits=1)


@pytest.mark.parametrize("num_splits", [2, 5])
def test_verify_split_k_with_splits_past_some_tokens(num_splits):
    # 60 + 8 keys in tiles of 16: with 5 splits the last holds keys 64-67 only, past the
    # first tokens' positions (60-63): those rows see no key there.
    _check_verify([(8, 60), (1, 3), (4, 30)], 4, 2, 64, 16, torch.float32, num_splits=num_splits, block_n=16)


@pytest.mark.parametrize("num_splits", [1, 5])
def test_verify_read_ahead(num_splits):
    """The engine's launch: the first K/V tile read before the PDL wait, the new tokens' rows again after it."""
    _check_verify([(8, 60), (1, 3), (4, 30), (5, 0)], 4, 2, 64, 16, torch.float32, num_splits=num_splits,
                  block_n=16, read_ahead=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_verify_dtypes_head_dim_128(dtype):
    _check_verify([(5, 27), (2, 9)], 8, 2, 128, 32, dtype, num_splits=2)


@pytest.mark.parametrize("num_splits", [1, 5])
def test_verify_fp8_cache(num_splits):
    _check_verify([(8, 60), (1, 3), (4, 30)], 4, 2, 64, 16, torch.float16, cache_dtype=KV_FP8,
                  num_splits=num_splits, block_n=16)


def test_verify_fits_and_refuses_by_name():
    assert paged_verify_fits(16, 4) and paged_verify_fits(5, 4) and not paged_verify_fits(17, 4)
    assert not paged_verify_fits(0, 4)
    kv = make_paged_kv([40], 1, 64, 16, torch.float32, DEVICE)
    q = torch.zeros(40, 4, 64, device=DEVICE)
    cu = torch.tensor([0, 40], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="paged_verify holds at most 64 rows"):
        paged_verify(q, kv.k_cache, kv.v_cache, cu, kv.seq_lens, kv.block_tables, 0.125, 40)


@pytest.mark.gpu
@pytest.mark.parametrize("chunks", [[(5, 4091)] * 8, [(5, 100), (9, 4087), (1, 31), (16, 2000)], [(5, 32763)]])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(32, 8), (16, 2), (8, 8)])
@pytest.mark.parametrize("dtype,block_size", [(torch.bfloat16, 16), (torch.float16, 32), (torch.float32, 16)])
def test_verify_gpu(chunks, num_q_heads, num_kv_heads, dtype, block_size):
    group = num_q_heads // num_kv_heads
    chunks = [(min(n, 64 // group), c) for n, c in chunks]  # what paged_verify_fits lets the engine send
    _check_verify(chunks, num_q_heads, num_kv_heads, 128, block_size, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("chunks", [[(5, 4091)] * 8, [(5, 100), (9, 4087), (1, 31), (16, 2000)]])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_verify_gpu_fp8_cache(chunks, dtype):
    chunks = [(min(n, 16), c) for n, c in chunks]
    _check_verify(chunks, 32, 8, 128, 16, dtype, cache_dtype=KV_FP8)


@pytest.mark.gpu
def test_verify_gpu_mid_batch_defaults():
    """24 sequences x 8 KV heads, 1-5 new tokens each: one split of 128-key tiles by default."""
    _check_verify([(1 + i % 5, (i * 397) % 3000) for i in range(24)], 32, 8, 128, 16, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 7, 64])
@pytest.mark.parametrize("block_n,num_warps,num_stages", [(32, 4, 2), (64, 4, 3)])
def test_verify_gpu_tunings(num_splits, block_n, num_warps, num_stages):
    _check_verify([(5, 3000), (1, 17), (5, 60)], 32, 8, 128, 16, torch.bfloat16, num_splits=num_splits,
                  block_n=block_n, num_warps=num_warps, num_stages=num_stages)
