"""rotary_cache_write against the float64 rotation and the reference scatter: GQA head
counts, head dims with and without a power-of-2 half, q, k and v as strided views of one
fused qkv output whose row padding holds NaN that must stay untouched, int32/int64
positions and slots, negative (padding) slots rotated but not written, block sizes 16/32;
with each head RMS-normalized first (Qwen3's q_norm and k_norm) against the torch module's
norm of each head."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.fp8 import KV_FP8
from pdserve.kernels.rotary import rotary_cache_write
from tests.kernels.reference import ref_cache_write, ref_rms_norm, ref_rotary, rope_tables, rounding_tolerance

COVERS = ("rotary_cache_write",)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAD = 3  # NaN elements after each token's fused q, k, v


def _check(num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
           index_dtype: torch.dtype, fused: bool, max_positions: int = 4096, block_size: int = 16,
           num_blocks: int = 4, read_ahead: bool = False, cache_dtype: torch.dtype | None = None,
           scale: float = 1.0, head_norms: bool = False) -> None:
    cos, sin = (t.to(DEVICE) for t in rope_tables(head_dim, max_positions))
    positions = torch.randint(0, max_positions, (num_tokens,), device=DEVICE).to(index_dtype)
    positions[0] = max_positions - 1
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    if fused:
        qkv = torch.full((num_tokens, q_size + 2 * kv_size + PAD), float("nan"), dtype=dtype, device=DEVICE)
        qkv[:, :q_size + 2 * kv_size] = torch.randn(num_tokens, q_size + 2 * kv_size, device=DEVICE).to(dtype)
        q = qkv[:, :q_size].view(num_tokens, num_q_heads, head_dim)
        k = qkv[:, q_size:q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
        v = qkv[:, q_size + kv_size:q_size + 2 * kv_size].view(num_tokens, num_kv_heads, head_dim)
    else:
        q, k, v = ((torch.randn(num_tokens, h, head_dim, device=DEVICE) * scale).to(dtype)
                   for h in (num_q_heads, num_kv_heads, num_kv_heads))
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=cache_dtype or dtype, device=DEVICE)
    v_cache = torch.full(shape, float("nan"), dtype=cache_dtype or dtype, device=DEVICE)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens].to(index_dtype)
    slots[1::3] = -1  # padding tokens
    norms = None
    q_in, k_in = q, k
    if head_norms:
        weights = (torch.rand(2, head_dim, device=DEVICE) + 0.5).to(dtype)
        norms = (weights[0], weights[1], 1e-6)
        q_in, k_in = ref_rms_norm(q, norms[0], norms[2])[0], ref_rms_norm(k, norms[1], norms[2])[0]
    q_ref, k_ref = ref_rotary(q_in, positions, cos, sin), ref_rotary(k_in, positions, cos, sin)
    v_before = v.clone()

    rotary_cache_write(q, k, v, positions, cos, sin, k_cache, v_cache, slots, read_ahead=read_ahead,
                       head_norms=norms)

    tol = rounding_tolerance(dtype)
    if head_norms:
        # The norm's fp32 sum of squares runs in another order than the reference's, so a
        # normalized element's rounding to the dtype flips now and then (13 of 33.5 M at 8k
        # tokens in bf16 on the H100): an ulp of a value near 1, which the rotation mixes into
        # both halves. Bounded by a few ulps of 1, not relatively (the sum may be near 0).
        tol = {"rtol": 3 * torch.finfo(dtype).eps, "atol": max(1e-5, 4 * torch.finfo(dtype).eps)}
    tol["atol"] *= scale  # values scale x larger, ulps too
    torch.testing.assert_close(q.double(), q_ref, **tol)
    if cache_dtype == KV_FP8:
        _check_fp8(k, v, v_before, k_ref, k_cache, v_cache, slots, tol)
    else:
        torch.testing.assert_close(k.double(), k_ref, **tol)
        assert torch.equal(v, v_before)
        # The cache: the rotated k as the kernel left it in place, v as given, at each real
        # token's slot; every other slot keeps its NaN poison.
        k_want, v_want = ref_cache_write(k, v, k_cache, v_cache, slots)
        assert torch.allclose(k_cache, k_want, rtol=0, atol=0, equal_nan=True)
        assert torch.allclose(v_cache, v_want, rtol=0, atol=0, equal_nan=True)
    if fused:  # the row padding
        assert qkv[:, q_size + 2 * kv_size:].isnan().all()


def _check_fp8(k: torch.Tensor, v: torch.Tensor, v_before: torch.Tensor, k_ref: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, tol: dict[str, float]) -> None:
    """An FP8 cache: each written token's rotated k and its v rounded to e4m3 (as `quantize`
    rounds the reference's rotation, up to a boundary case where the two rotations' last
    bits differ) at its slot, and left in place as the cache holds them; a padding token's k
    rotated and not rounded, its v untouched; every other slot keeps its NaN."""
    written = slots >= 0
    k_want, v_want = ref_cache_write(k_ref.to(k.dtype), v_before, k_cache, v_cache, slots)
    got_k, got_v = k_cache.float(), v_cache.float()
    assert torch.equal(got_v.isnan(), v_want.isnan()) and torch.equal(got_k.isnan(), k_want.isnan())
    assert torch.equal(got_v.nan_to_num(), v_want.nan_to_num())  # v is given: rounded exactly as quantize does
    same = got_k.nan_to_num() == k_want.nan_to_num()
    assert same.float().mean() > 0.99, same.float().mean()
    torch.testing.assert_close(got_k.nan_to_num(), k_want.nan_to_num(), rtol=0.07, atol=2.0 ** -9)
    k_flat, v_flat = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    rows = slots[written].long()
    assert torch.equal(k[written], k_flat[rows].to(k.dtype)) and torch.equal(v[written], v_flat[rows].to(v.dtype))
    torch.testing.assert_close(k[~written].double(), k_ref[~written], **tol)
    assert torch.equal(v[~written], v_before[~written])


@pytest.mark.parametrize("num_tokens", [1, 6])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 1, 128), (2, 2, 80)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fused", [True, False])
def test_rotary_cache_write(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, fused):
    _check(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, torch.int64, fused)


@pytest.mark.parametrize("block_size", [16, 32])
def test_int32_positions_and_slots(block_size):
    _check(17, 4, 2, 64, torch.float32, torch.int32, fused=True, block_size=block_size, num_blocks=2)


def test_read_ahead():
    """The engine's launch: positions, slots and tables read before the PDL wait."""
    _check(6, 9, 3, 64, torch.float16, torch.int64, fused=True, read_ahead=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_cache(dtype):
    """An FP8 cache: values past +-448 saturate, the rest round to nearest-even (scaled up,
    so that many land beyond 448 and on every binade of e4m3)."""
    _check(6, 9, 3, 64, dtype, torch.int64, fused=False, cache_dtype=KV_FP8, scale=200.0)


@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(9, 3, 64), (2, 2, 80)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_heads_normalized_first(num_q_heads, num_kv_heads, head_dim, dtype):
    """Qwen3: each q and k head RMS-normalized by its weight before the rotation, in one kernel."""
    _check(6, num_q_heads, num_kv_heads, head_dim, dtype, torch.int64, fused=True, head_norms=True)


def test_no_tokens():
    cos, sin = (t.to(DEVICE) for t in rope_tables(64, 16))
    q = torch.empty(0, 2, 64, device=DEVICE)
    k_cache = torch.zeros(1, 16, 1, 64, device=DEVICE)
    none = torch.empty(0, dtype=torch.int64, device=DEVICE)
    rotary_cache_write(q, q[:, :1], q[:, 1:], none, cos, sin, k_cache, k_cache.clone(), none)
    assert not k_cache.any()


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 8192])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(32, 8, 128), (9, 3, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_norms", [False, True])
def test_rotary_cache_write_gpu(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, head_norms):
    _check(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, torch.int64, fused=True,
           max_positions=131072, num_blocks=1024, head_norms=head_norms)
