"""flash_prefill_ws against an fp32 torch SDPA reference (causal, GQA), on an H100/H200.

    pytest -q -m gpu /tmp/gluon/test_flash_prefill_ws.py
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from flash_prefill_ws import flash_prefill_ws

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
LENGTHS = [1, 15, 16, 17, 200, 1000, 4096]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                       reason="needs a Hopper GPU (sm_90)"),
]


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], scale: float) -> torch.Tensor:
    """Causal attention per sequence in fp32; q [tokens, Hq, D], k/v [tokens, Hkv, D]."""
    group = q.shape[1] // k.shape[1]
    out, start = [], 0
    for n in lengths:
        qs = q[start:start + n].float().transpose(0, 1)                                  # [Hq, n, D]
        ks = k[start:start + n].float().repeat_interleave(group, dim=1).transpose(0, 1)
        vs = v[start:start + n].float().repeat_interleave(group, dim=1).transpose(0, 1)
        out.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1))
        start += n
    return torch.cat(out)


def run_case(lengths: list[int], paired: bool, seed: int) -> float:
    torch.manual_seed(seed)
    num_tokens = sum(lengths)
    q = torch.randn(num_tokens, NUM_Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cu_seqlens = torch.tensor([0] + lengths, device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)
    scale = HEAD_DIM ** -0.5
    out = torch.full_like(q, float("nan"))  # every row must be written
    flash_prefill_ws(q, k, v, cu_seqlens, max(lengths), scale, out=out, paired=int(paired))
    torch.cuda.synchronize()
    ref = reference(q, k, v, lengths, scale)
    assert not out.isnan().any(), f"{int(out.isnan().any(-1).any(-1).sum())} rows unwritten or NaN"
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("paired", [False, True])
@pytest.mark.parametrize("length", LENGTHS)
def test_single_sequence(length: int, paired: bool) -> None:
    assert run_case([length], paired, seed=length) < 1e-2


@pytest.mark.parametrize("paired", [False, True])
def test_ragged_batch(paired: bool) -> None:
    # Packed back to back: tiles that run past a sequence's end read the next one's K/V.
    assert run_case([17, 4096, 1, 200, 15, 1000, 16], paired, seed=1) < 1e-2


@pytest.mark.parametrize("paired", [False, True])
def test_many_tiles_both_parities(paired: bool) -> None:
    # Loop trip counts 0..5 and both leftovers of the paired loop, over several lengths.
    lengths = [128 * t + d for t in range(1, 7) for d in (0, 1, 64, 65)]
    assert run_case(lengths, paired, seed=2) < 1e-2


def test_strided_views_and_out_rows() -> None:
    # q/k/v as views of one fused qkv tensor (the engine's case); rows stay 16-byte aligned.
    torch.manual_seed(3)
    lengths = [300, 129]
    num_tokens = sum(lengths)
    qkv = torch.randn(num_tokens, (NUM_Q_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    q = qkv[:, :NUM_Q_HEADS * HEAD_DIM].view(num_tokens, NUM_Q_HEADS, HEAD_DIM)
    k = qkv[:, NUM_Q_HEADS * HEAD_DIM:(NUM_Q_HEADS + NUM_KV_HEADS) * HEAD_DIM].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    v = qkv[:, (NUM_Q_HEADS + NUM_KV_HEADS) * HEAD_DIM:].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    cu_seqlens = torch.tensor([0, 300, 429], device="cuda", dtype=torch.int32)
    out = flash_prefill_ws(q, k, v, cu_seqlens, 300, HEAD_DIM ** -0.5)
    ref = reference(q, k, v, lengths, HEAD_DIM ** -0.5)
    assert float((out.double() - ref.double()).norm() / ref.double().norm()) < 1e-2
