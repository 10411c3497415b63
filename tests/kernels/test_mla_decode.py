"""mla_decode against the float64 absorbed-MLA reference: one token per sequence and the
verification form (a few new tokens per sequence, causal among them), split-K (with splits
past some tokens' positions), head counts below and above a program's block, fp32/fp16 and an
FP8 latent cache, strided query views, padding rows, the cache as a view of the pool. Outputs
start as NaN so an unwritten row fails; blocks no sequence owns hold NaN so a read outside a
sequence fails. CPU runs tiny shapes in the interpreter; `gpu` ones DeepSeek-V3's widths."""

from __future__ import annotations

import itertools

import pytest
import torch

from pdserve.kernels import mla_decode as mla_decode_module
from pdserve.kernels.fp8 import KV_FP8
from pdserve.kernels.mla_decode import mla_decode, mla_decode_default_splits, mla_decode_num_splits, mla_decode_tiling
from pdserve.kernels.split_merge import decode_workspace
from tests.kernels.reference import make_paged_latent, ref_mla_decode, rel_error, tolerance

COVERS = ("mla_decode", "mla_decode_default_splits", "mla_decode_num_splits", "mla_decode_tiling")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _check(
    chunks: list[tuple[int, int]], num_heads: int, kv_lora_rank: int, rope_dim: int, block_size: int,
    dtype: torch.dtype, cache_dtype: torch.dtype | None = None, verify: bool = False, strided_q: bool = False,
    with_workspace: bool = False, **launch: int,
) -> None:
    """chunks: (new tokens, earlier context) per sequence; without verify, one new token each."""
    q_lens = [n for n, _ in chunks]
    latent = make_paged_latent([n + c for n, c in chunks], kv_lora_rank + rope_dim, block_size, dtype, DEVICE,
                               cache_dtype=cache_dtype)
    num_tokens = sum(q_lens)
    if strided_q:  # views of one [tokens, heads, rank + rope] query, as the model's projection gives
        q = torch.randn(num_tokens, num_heads, kv_lora_rank + rope_dim, device=DEVICE).to(dtype)
        q_nope, q_pe = q[..., :kv_lora_rank], q[..., kv_lora_rank:]
    else:
        q_nope = torch.randn(num_tokens, num_heads, kv_lora_rank, device=DEVICE).to(dtype)
        q_pe = torch.randn(num_tokens, num_heads, rope_dim, device=DEVICE).to(dtype)
    scale = (kv_lora_rank + rope_dim) ** -0.5
    out = torch.full_like(q_nope, float("nan"))
    kwargs = dict(launch)
    if verify:
        kwargs["cu_seqlens_q"] = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=DEVICE)
        kwargs["max_seqlen_q"] = max(q_lens)
    if with_workspace:
        kwargs["workspace"] = decode_workspace(num_tokens, num_heads, kv_lora_rank, kwargs.pop("num_splits"), DEVICE)
    got = mla_decode(q_nope, q_pe, latent.cache, latent.block_tables, latent.seq_lens, scale, out=out, **kwargs)
    assert got is out
    want = ref_mla_decode(q_nope, q_pe, latent, q_lens, scale)
    assert rel_error(out, want) < tolerance(dtype), rel_error(out, want)
    for b, start in enumerate(itertools.accumulate([0, *q_lens[:-1]])):  # no short one hides behind a long one
        n = q_lens[b]
        if n:
            assert rel_error(out[start:start + n], want[start:start + n]) < tolerance(dtype), (b, chunks[b])


@pytest.mark.parametrize("contexts", [[0], [16, 100, 3]])
@pytest.mark.parametrize("num_heads", [2, 16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_shapes(contexts, num_heads, num_splits):
    _check([(1, c) for c in contexts], num_heads, 32, 16, 16, torch.float32, num_splits=num_splits)


def test_decode_heads_past_one_block_rank_64():
    # 16 heads in blocks of 4: four programs a sequence share each latent tile through L2.
    _check([(1, 40), (1, 7)], 16, 64, 16, 16, torch.float32, num_splits=2, block_h=4)


def test_decode_fp16_strided_query_and_workspace():
    """The CUDA-graph launch: a preallocated workspace, q_nope and q_pe views of one tensor."""
    _check([(1, 60), (1, 5)], 4, 32, 16, 16, torch.float16, strided_q=True, with_workspace=True, num_splits=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_fp8_latent_cache(dtype):
    _check([(1, 70), (1, 9)], 4, 32, 16, 16, dtype, cache_dtype=KV_FP8, num_splits=2)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_verify(num_splits):
    # 2-3 new tokens after 0-61 keys; with 4 splits of 16-key tiles the last split of the
    # first sequence (keys 48-63) starts past its first token's position (61): that row
    # sees no key there.
    _check([(3, 61), (2, 14), (3, 0), (2, 30)], 4, 32, 16, 16, torch.float32, verify=True, num_splits=num_splits)


def test_verify_fp8_cache_and_ragged_chunks():
    """A verification step beside a sequence whose chunk is one token, and an empty one."""
    _check([(3, 37), (1, 5), (0, 9), (2, 20)], 2, 32, 16, 16, torch.float16, cache_dtype=KV_FP8, verify=True,
           num_splits=3)


def test_padding_row_and_pool_view():
    """A CUDA-graph padding row (seq_len 0) gives zeros; the cache may be a layer of the pool
    [layers, 1, blocks, block_size, 1, latent] (a contiguous view)."""
    latent = make_paged_latent([20, 1], 48, 16, torch.float32, DEVICE)
    pool = torch.full((2, 1, *latent.cache.shape[:2], 1, 48), float("nan"), device=DEVICE)
    pool[1, 0, :, :, 0] = latent.cache
    seq_lens = torch.tensor([20, 0], dtype=torch.int32, device=DEVICE)
    q_nope, q_pe = torch.randn(2, 2, 32, device=DEVICE), torch.randn(2, 2, 16, device=DEVICE)
    for num_splits in (1, 2):
        out = mla_decode(q_nope, q_pe, pool[1, 0, :, :, 0], latent.block_tables, seq_lens, 0.1, num_splits=num_splits)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        assert rel_error(out[:1], ref_mla_decode(q_nope[:1], q_pe[:1], latent, [1], 0.1)) < 1e-4


def test_refuses_by_name():
    latent = make_paged_latent([4, 4], 48, 16, torch.float32, DEVICE)
    q_nope, q_pe = torch.zeros(4, 2, 32, device=DEVICE), torch.zeros(4, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="one token per sequence"):
        mla_decode(q_nope, q_pe, latent.cache, latent.block_tables, latent.seq_lens, 0.1)
    with pytest.raises(AssertionError, match="kv_lora_rank \\+ rope_dim"):
        mla_decode(q_nope[:2], q_pe[:2, :, :8], latent.cache, latent.block_tables, latent.seq_lens, 0.1)


def test_num_splits_and_tiling(monkeypatch):
    """On a 132-multiprocessor card: one split once the programs fill it, below it one wave of
    programs (one a multiprocessor at 64 rows, two at fewer), never splits under 32 tokens or
    twice the heads, nor over 32; rows of 16 on the CPU."""
    monkeypatch.setattr(mla_decode_module, "_num_sms", lambda device: 132)
    cuda = torch.device("cuda")
    assert mla_decode_num_splits(256, 128, 64, 1536, cuda) == 1
    assert mla_decode_num_splits(64, 128, 64, 4096, cuda) == 1   # 128 programs: one wave already
    assert mla_decode_num_splits(64, 16, 16, 4096, cuda) == 4    # 256 programs of 16 rows, two an SM
    assert mla_decode_num_splits(16, 128, 32, 4096, cuda, 2) == 2    # 2 tokens x 32 heads: 64 rows
    assert mla_decode_num_splits(16, 16, 16, 4096, cuda, 2) == 16    # 2 tokens x 16 heads: 32 rows
    assert mla_decode_num_splits(1, 128, 64, 32768, cuda) == 32
    assert mla_decode_num_splits(1, 16, 16, 600, cuda) == 18     # 32-token splits
    assert mla_decode_num_splits(1, 128, 64, 1024, cuda) == 4    # 256-token splits at 128 heads
    q = torch.zeros(1, 16, 32)
    assert mla_decode_tiling(q, 16, 1)["block_h"] == 16 and mla_decode_tiling(q, 16, 3)["block_h"] == 4
    assert mla_decode_tiling(q, 2, 1)["block_h"] == 2


@pytest.mark.parametrize("num_seqs, num_heads, q_len", [(1, 16, 1), (3, 4, 1), (2, 16, 3)])
def test_default_splits_are_what_a_launch_without_them_uses(monkeypatch, num_seqs, num_heads, q_len):
    """mla_decode_default_splits (what a CUDA graph's context tier is sized by) equals the
    split count mla_decode launches with when given none, read off its kernel's grid."""
    monkeypatch.setattr(mla_decode_module, "_num_sms", lambda device: 132)
    kernel, grids = mla_decode_module._mla_split_kernel, []

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(mla_decode_module, "_mla_split_kernel", Spy())
    latent = make_paged_latent([40 * (b + 1) for b in range(num_seqs)], 32 + 16, 16, torch.float32, DEVICE)
    q_nope = torch.randn(num_seqs * q_len, num_heads, 32, device=DEVICE)
    q_pe = torch.randn(num_seqs * q_len, num_heads, 16, device=DEVICE)
    verify = {} if q_len == 1 else {
        "cu_seqlens_q": torch.arange(0, (num_seqs + 1) * q_len, q_len, dtype=torch.int32, device=DEVICE),
        "max_seqlen_q": q_len}
    # A table wide enough that the context, not the batch, bounds the splits.
    tables = torch.cat([latent.block_tables, latent.block_tables.new_zeros(num_seqs, 60)], dim=1)
    mla_decode(q_nope, q_pe, latent.cache, tables, latent.seq_lens, 0.1, **verify)
    want = mla_decode_default_splits(num_seqs, num_heads, tables.shape[1] * 16, torch.float32,
                                     torch.device(DEVICE), q_len)
    assert want > 1 and grids[0][2] == want, (grids, want)


# DeepSeek-V3's widths: 128 heads (one GPU) or 16 (TP 8), latent 512 + 64.
GPU_CHUNKS = [[(1, 4095)] * 8, [(1, 100), (1, 4000), (1, 31), (1, 1999), (1, 0)], [(1, 32767)]]


@pytest.mark.gpu
@pytest.mark.parametrize("chunks", GPU_CHUNKS)
@pytest.mark.parametrize("num_heads", [128, 16])
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.bfloat16, None), (torch.bfloat16, KV_FP8),
                                               (torch.float16, None), (torch.float32, None)])
def test_decode_gpu(chunks, num_heads, dtype, cache_dtype):
    _check(chunks, num_heads, 512, 64, 64 if dtype == torch.bfloat16 else 16, dtype, cache_dtype=cache_dtype,
           strided_q=True)


@pytest.mark.gpu
@pytest.mark.parametrize("chunks", [[(2, 4090)] * 8, [(4, 100), (1, 4000), (3, 31), (4, 2000)]])
@pytest.mark.parametrize("cache_dtype", [None, KV_FP8])
def test_verify_gpu(chunks, cache_dtype):
    _check(chunks, 128, 512, 64, 64, torch.bfloat16, cache_dtype=cache_dtype, verify=True)


@pytest.mark.gpu
@pytest.mark.parametrize("block_h,block_n,num_warps,num_stages",
                         [(16, 32, 4, 2), (32, 32, 4, 2), (64, 32, 8, 2), (64, 16, 8, 3), (64, 64, 8, 1)])
@pytest.mark.parametrize("num_splits", [1, 5])
def test_decode_gpu_tunings(block_h, block_n, num_warps, num_stages, num_splits):
    _check([(1, 3000), (1, 17), (1, 600)], 128, 512, 64, 64, torch.bfloat16, block_h=block_h, block_n=block_n,
           num_warps=num_warps, num_stages=num_stages, num_splits=num_splits)
