"""apply_rotary against the float64 reference: GQA head counts, head dims with and
without a power-of-2 half, q and k as strided views of one fused qkv output whose V
and row padding hold NaN that must stay untouched, int32/int64 positions."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import apply_rotary
from tests.kernels.reference import ref_rotary, rope_tables, rounding_tolerance

COVERS = ("apply_rotary",)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAD = 3  # NaN elements after each token's fused q, k, v


def _check_rotary(num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                  pos_dtype: torch.dtype, fused: bool, max_positions: int = 4096) -> None:
    cos, sin = (t.to(DEVICE) for t in rope_tables(head_dim, max_positions))
    positions = torch.randint(0, max_positions, (num_tokens,), device=DEVICE).to(pos_dtype)
    positions[0] = max_positions - 1
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    if fused:
        qkv = torch.full((num_tokens, q_size + 2 * kv_size + PAD), float("nan"), dtype=dtype, device=DEVICE)
        qkv[:, :q_size + kv_size] = torch.randn(num_tokens, q_size + kv_size, device=DEVICE).to(dtype)
        q = qkv[:, :q_size].view(num_tokens, num_q_heads, head_dim)
        k = qkv[:, q_size:q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    else:
        q = torch.randn(num_tokens, num_q_heads, head_dim, device=DEVICE).to(dtype)
        k = torch.randn(num_tokens, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    q_ref, k_ref = ref_rotary(q, positions, cos, sin), ref_rotary(k, positions, cos, sin)
    apply_rotary(q, k, positions, cos, sin)
    tol = rounding_tolerance(dtype)
    torch.testing.assert_close(q.double(), q_ref, **tol)
    torch.testing.assert_close(k.double(), k_ref, **tol)
    if fused:  # V and the row padding
        assert qkv[:, q_size + kv_size:].isnan().all()


@pytest.mark.parametrize("num_tokens", [1, 6])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 1, 128), (2, 2, 80)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fused", [True, False])
def test_rotary(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, fused):
    _check_rotary(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, torch.int64, fused)


def test_rotary_int32_positions():
    _check_rotary(5, 4, 2, 64, torch.float32, torch.int32, fused=True)


def test_rotary_no_tokens():
    cos, sin = (t.to(DEVICE) for t in rope_tables(64, 16))
    q = torch.empty(0, 2, 64, device=DEVICE)
    apply_rotary(q, q[:, :1], torch.empty(0, dtype=torch.int64, device=DEVICE), cos, sin)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 8192])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(32, 8, 128), (9, 3, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rotary_gpu(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype):
    _check_rotary(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, torch.int64, fused=True,
                  max_positions=131072)
