"""mla_prefill against the float64 reference: ragged batches, queries after a cached prefix
(chunked prefill, prefix hits), lengths around a tile's edge, a value width other than the
key's, k_pe shared by the heads, strided views of projection outputs, fp32/fp16. And the two
MLA forms agree: the absorbed decode (mla_decode, then W_UV) equals this kernel over the
latents expanded through W_UK and W_UV. Outputs start as NaN so an unwritten row fails."""

from __future__ import annotations

import itertools

import pytest
import torch

from pdserve.kernels.mla_decode import mla_decode
from pdserve.kernels.mla_prefill import mla_prefill, mla_prefill_tuning
from tests.kernels.reference import make_paged_latent, ref_mla_prefill, rel_error, slot_mapping, tolerance

COVERS = ("mla_prefill", "mla_prefill_tuning")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=DEVICE)


def _check(
    q_lens: list[int], context_lens: list[int], num_heads: int, nope_dim: int, rope_dim: int, v_dim: int,
    dtype: torch.dtype, strided: bool = False, **tuning: int,
) -> None:
    k_lens = [c + n for c, n in zip(context_lens, q_lens)]
    nq, nk = sum(q_lens), sum(k_lens)
    if strided:  # views of the projections' outputs: q [.., nope + rope], kv [.., nope + v], latent [.., rank + rope]
        q = torch.randn(nq, num_heads, nope_dim + rope_dim, device=DEVICE).to(dtype)
        kv = torch.randn(nk, num_heads, nope_dim + v_dim, device=DEVICE).to(dtype)
        latent = torch.randn(nk, 32 + rope_dim, device=DEVICE).to(dtype)
        q_nope, q_pe, k_nope, v, k_pe = q[..., :nope_dim], q[..., nope_dim:], kv[..., :nope_dim], kv[..., nope_dim:], \
            latent[:, 32:]
    else:
        q_nope = torch.randn(nq, num_heads, nope_dim, device=DEVICE).to(dtype)
        q_pe = torch.randn(nq, num_heads, rope_dim, device=DEVICE).to(dtype)
        k_nope = torch.randn(nk, num_heads, nope_dim, device=DEVICE).to(dtype)
        k_pe = torch.randn(nk, 1, rope_dim, device=DEVICE).to(dtype)
        v = torch.randn(nk, num_heads, v_dim, device=DEVICE).to(dtype)
    out = torch.full((nq, num_heads, v_dim), float("nan"), dtype=dtype, device=DEVICE)
    scale = (nope_dim + rope_dim) ** -0.5
    got = mla_prefill(q_nope, q_pe, k_nope, k_pe, v, _cu(q_lens), _cu(k_lens), scale, max(q_lens), out=out, **tuning)
    assert got is out
    want = ref_mla_prefill(q_nope, q_pe, k_nope, k_pe.reshape(nk, rope_dim), v, q_lens, k_lens, scale)
    assert rel_error(out, want) < tolerance(dtype), rel_error(out, want)


# (q_lens, context_lens): around a 16-token tile edge, ragged, and after a cached prefix.
CPU_SHAPES = [([1], [0]), ([16], [0]), ([17], [0]), ([5, 17, 1], [20, 3, 40])]


@pytest.mark.parametrize("q_lens,context_lens", CPU_SHAPES)
@pytest.mark.parametrize("num_heads", [1, 3])
def test_prefill_shapes(q_lens, context_lens, num_heads):
    _check(q_lens, context_lens, num_heads, 32, 16, 64, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_strided_views_value_narrower(dtype):
    # DeepSeek's proportions at a quarter: key 32 + 16 wide, value 32 (V3: 128 + 64, 128).
    _check([19, 2], [14, 30], 2, 32, 16, 32, dtype, strided=True)


def test_prefill_key_tiles_wider_than_query_tiles():
    _check([40, 7], [5, 0], 2, 32, 16, 16, torch.float32, block_m=16, block_n=32)


def test_prefill_tuning_defaults():
    assert mla_prefill_tuning(torch.float32, False) == {"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 1}
    assert mla_prefill_tuning(torch.bfloat16, True)["block_m"] >= 64


@pytest.mark.parametrize("context", [0, 37])
def test_absorbed_decode_equals_expanded_prefill(context):
    """The last token of a sequence, both ways: mla_decode over the latent cache with
    q_nope @ W_UK as the query, times W_UV; and mla_prefill over the latents expanded to
    per-head keys [c_kv @ W_UK^T, k_pe] and values c_kv @ W_UV."""
    num_heads, rank, rope, nope, v_dim, block_size = 2, 32, 16, 16, 32, 16
    seq_len = context + 1
    latent = make_paged_latent([seq_len], rank + rope, block_size, torch.float32, DEVICE)
    slots = torch.tensor(slot_mapping(latent.block_tables.cpu(), 0, range(seq_len), block_size), device=DEVICE)
    rows = latent.cache.flatten(0, 1)[slots]                                  # [seq_len, rank + rope]
    c_kv, k_pe = rows[:, :rank], rows[:, rank:]
    w_uk = torch.randn(num_heads, nope, rank, device=DEVICE) * rank ** -0.5  # kv_b_proj's key part
    w_uv = torch.randn(num_heads, rank, v_dim, device=DEVICE) * rank ** -0.5  # and its value part
    q_nope = torch.randn(1, num_heads, nope, device=DEVICE)
    q_pe = torch.randn(1, num_heads, rope, device=DEVICE)
    scale = (nope + rope) ** -0.5

    absorbed = torch.einsum("thn,hnc->thc", q_nope, w_uk)
    latent_out = mla_decode(absorbed, q_pe, latent.cache, latent.block_tables, latent.seq_lens, scale, num_splits=2)
    decoded = torch.einsum("thc,hcv->thv", latent_out, w_uv)

    k_nope = torch.einsum("kc,hnc->khn", c_kv, w_uk).contiguous()
    v = torch.einsum("kc,hcv->khv", c_kv, w_uv).contiguous()
    prefilled = mla_prefill(q_nope, q_pe, k_nope, k_pe, v, _cu([1]), _cu([seq_len]), scale, 1)
    assert rel_error(decoded, prefilled) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("q_lens,context_lens", [([1, 15, 16, 17, 1000], [0] * 5), ([3000, 1, 129], [0, 2047, 4000]),
                                                 ([512, 700], [1536, 9])])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_prefill_gpu_v3_widths(q_lens, context_lens, dtype):
    _check(q_lens, context_lens, 16, 128, 64, 128, dtype, strided=True)


@pytest.mark.gpu
@pytest.mark.parametrize("block_m,block_n,num_warps,num_stages", [(64, 64, 4, 2), (128, 64, 8, 2), (128, 32, 8, 3),
                                                                   (64, 32, 4, 3)])
def test_prefill_gpu_tunings(block_m, block_n, num_warps, num_stages):
    _check([1, 777, 2048], [0, 100, 3], 16, 128, 64, 128, torch.bfloat16, strided=True, block_m=block_m,
           block_n=block_n, num_warps=num_warps, num_stages=num_stages)
