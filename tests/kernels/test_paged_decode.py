"""paged_decode against the float64 reference: one query per sequence, GQA, block
sizes 16/32, split-K with a preallocated workspace, padded rows."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.kernels.fp8 import KV_FP8
from pdserve.kernels.paged_decode import decode_num_splits, paged_decode
from pdserve.kernels.split_merge import decode_workspace
from tests.kernels.reference import make_paged_kv, ref_paged_attention, rel_error, tolerance

COVERS = ("paged_decode", "decode_num_splits",
          "decode_workspace", "merge_splits", "workspace_args", "num_sms")  # split_merge: through the split cases
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _check_decode(
    seq_lens: list[int], num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
    dtype: torch.dtype, num_splits: int | None = None, use_workspace: bool = False,
    cache_dtype: torch.dtype | None = None, **tuning: int,
) -> None:
    kv = make_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, dtype, DEVICE, cache_dtype=cache_dtype)
    batch = len(seq_lens)
    q = torch.randn(batch, num_q_heads, head_dim, device=DEVICE).to(dtype)
    out = torch.full_like(q, float("nan"))
    workspace = None
    if use_workspace:  # oversized in batch, NaN-poisoned: every used entry must be written
        workspace = decode_workspace(batch + 2, num_q_heads, head_dim, num_splits, DEVICE).fill_(float("nan"))
        num_splits = None
    scale = head_dim ** -0.5
    got = paged_decode(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale, out=out,
                       workspace=workspace, num_splits=num_splits, **tuning)
    assert got is out
    ref = ref_paged_attention(q, kv, [1] * batch, scale)
    err = rel_error(out, ref)
    assert err < tolerance(dtype), err


@pytest.mark.parametrize("seq_lens", [[1], [15], [16], [17], [1, 15, 16, 17, 33]])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (4, 1), (8, 1)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_shapes(seq_lens, num_q_heads, num_kv_heads, block_size):
    _check_decode(seq_lens, num_q_heads, num_kv_heads, 64, block_size, torch.float32, num_splits=1)


@pytest.mark.parametrize("num_splits", [2, 3, 5])
@pytest.mark.parametrize("use_workspace", [False, True])
def test_decode_split_k(num_splits, use_workspace):
    # 5 splits over 3 tiles of 16 leave some splits empty for the short sequences.
    _check_decode([70, 1, 40], 4, 2, 64, 16, torch.float32, num_splits=num_splits, use_workspace=use_workspace)


@pytest.mark.parametrize("num_splits", [1, 5])
def test_decode_read_ahead(num_splits):
    """The engine's launch: the first K/V tile read before the PDL wait, the new token's row again after it."""
    _check_decode([70, 1, 40, 16], 4, 2, 64, 16, torch.float32, num_splits=num_splits, read_ahead=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_dtypes_head_dims(dtype, head_dim):
    _check_decode([33, 17], 8, 2, head_dim, 32, dtype, num_splits=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_fp8_cache(dtype, num_splits):
    """An FP8 cache, widened to q's dtype: the same attention over the values it holds."""
    _check_decode([1, 17, 40], 4, 2, 64, 16, dtype, num_splits=num_splits, cache_dtype=KV_FP8)


# Deeper pipelines of the FP8 sweep (benchmarks/kernels.py): from five stages the compiled
# kernel holds two K/V tiles (test_shared_memory.py); the interpreter runs the tiles, not stages.
FP8_TILINGS = [(128, 4, 5), (128, 4, 8), (64, 4, 6), (32, 4, 8)]


@pytest.mark.parametrize("block_n,num_warps,num_stages", [(32, 4, 8), (64, 4, 6)])
def test_decode_fp8_cache_tilings(block_n, num_warps, num_stages):
    _check_decode([1, 70, 200], 8, 2, 64, 16, torch.float16, num_splits=2, use_workspace=True, cache_dtype=KV_FP8,
                  block_n=block_n, num_warps=num_warps, num_stages=num_stages)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_padded_rows_give_zeros(num_splits):
    kv = make_paged_kv([20, 1], 1, 64, 16, torch.float32, DEVICE)
    seq_lens = torch.tensor([20, 0], dtype=torch.int32, device=DEVICE)  # row 1 pads a graph batch
    q = torch.randn(2, 2, 64, device=DEVICE)
    out = paged_decode(q, kv.k_cache, kv.v_cache, kv.block_tables, seq_lens, 0.125, num_splits=num_splits)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert rel_error(out[:1], ref_paged_attention(q[:1], kv, [1], 0.125)) < 1e-4


def test_decode_num_splits_bounds():
    cpu = torch.device("cpu")
    assert decode_num_splits(1, 8, 128, 100, cpu) == 1          # too short to split
    assert decode_num_splits(256, 8, 128, 32768, cpu) == 1      # batch fills the GPU alone
    if torch.cuda.is_available():
        assert decode_num_splits(1, 8, 128, 32768, torch.device("cuda")) > 8


@pytest.mark.gpu
@pytest.mark.parametrize("seq_lens", [[1, 15, 16, 17, 33], [4096, 5, 1000], [32768]])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(8, 8), (32, 8), (16, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype,block_size",
                         [(torch.bfloat16, 16), (torch.bfloat16, 32), (torch.float16, 16), (torch.float32, 32)])
def test_decode_gpu(seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype):
    _check_decode(seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("seq_lens", [[1, 15, 16, 17, 33], [4096, 5, 1000]])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(32, 8), (16, 2)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_n", [64, 128])
def test_decode_gpu_fp8_cache(seq_lens, num_q_heads, num_kv_heads, dtype, block_n):
    _check_decode(seq_lens, num_q_heads, num_kv_heads, 128, 16, dtype, cache_dtype=KV_FP8, block_n=block_n)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 7])
@pytest.mark.parametrize("block_n,num_warps,num_stages", FP8_TILINGS)
def test_decode_gpu_fp8_tilings(num_splits, block_n, num_warps, num_stages):
    _check_decode([4096, 3000, 1, 17, 64], 32, 8, 128, 16, torch.bfloat16, num_splits=num_splits, use_workspace=True,
                  cache_dtype=KV_FP8, block_n=block_n, num_warps=num_warps, num_stages=num_stages)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 7, 64])
@pytest.mark.parametrize("block_n,num_warps,num_stages", [(32, 4, 2), (64, 4, 3), (128, 8, 2)])
def test_decode_gpu_tunings(num_splits, block_n, num_warps, num_stages):
    _check_decode([3000, 1, 17, 64], 32, 8, 128, 16, torch.bfloat16, num_splits=num_splits,
                  use_workspace=True, block_n=block_n, num_warps=num_warps, num_stages=num_stages)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_gpu_mid_batch_defaults(dtype):
    """24 sequences x 8 KV heads: a program or two a multiprocessor, so the launcher's
    defaults are one split of 128-key tiles (`_default_tiling`); ragged lengths."""
    lens = [1 + (i * 397) % 3000 for i in range(24)]
    assert decode_num_splits(len(lens), 8, 128, 4096, torch.device(DEVICE)) == 1
    _check_decode(lens, 32, 8, 128, 16, dtype)


@pytest.mark.gpu
def test_decode_cuda_graph_replay():
    """Given out and workspace, a launch allocates nothing and never syncs: capture it once,
    then replay on new queries and lengths."""
    kv = make_paged_kv([300, 70], 2, 128, 16, torch.bfloat16, DEVICE)
    q = torch.randn(2, 8, 128, device=DEVICE, dtype=torch.bfloat16)
    seq_lens = kv.seq_lens.clone()
    out = torch.empty_like(q)
    workspace = decode_workspace(2, 8, 128, 4, DEVICE)
    scale = 128 ** -0.5

    def step() -> None:
        paged_decode(q, kv.k_cache, kv.v_cache, kv.block_tables, seq_lens, scale, out=out, workspace=workspace)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    q.copy_(torch.randn_like(q))
    seq_lens.copy_(torch.tensor([123, 70], dtype=torch.int32))
    out.fill_(float("nan"))
    graph.replay()
    ref = ref_paged_attention(q, dataclasses.replace(kv, seq_lens=seq_lens), [1, 1], scale)
    assert rel_error(out, ref) < tolerance(torch.bfloat16)
