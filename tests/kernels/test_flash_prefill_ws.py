"""flash_prefill_ws (the Hopper kernel for prompts without earlier context) against a
float64 reference: one sequence around tile edges, ragged packed batches (tiles that run
past a sequence's end read the next one's K/V), GQA 1/4/8, bf16 and fp16, and views of a
fused qkv output. Outputs start as NaN so an unwritten row fails. The kernel runs only on
sm_90; without one, the tests check that it refuses clearly."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from kernels import flash_prefill_ws, flash_prefill_ws_supported
from tests.kernels.reference import rel_error, tolerance

COVERS = ("flash_prefill_ws", "flash_prefill_ws_supported")
HEAD_DIM = 128
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_hopper = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], scale: float) -> torch.Tensor:
    """Causal attention per sequence in float64; q [tokens, Hq, D], k/v [tokens, Hkv, D]."""
    group = q.shape[1] // k.shape[1]
    out, start = [], 0
    for n in lengths:
        qs, ks, vs = (x[start:start + n].double().repeat_interleave(g, dim=1).transpose(0, 1)
                      for x, g in ((q, 1), (k, group), (v, group)))
        out.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1))
        start += n
    return torch.cat(out)


def _check(lengths: list[int], num_q_heads: int, num_kv_heads: int, dtype: torch.dtype, fused: bool = False) -> None:
    num_tokens = sum(lengths)
    if fused:  # q, k, v as views of one projection output, as the engine passes them
        qkv = torch.randn(num_tokens, num_q_heads + 2 * num_kv_heads, HEAD_DIM, device="cuda").to(dtype)
        q, k, v = qkv.split([num_q_heads, num_kv_heads, num_kv_heads], dim=1)
    else:
        q = torch.randn(num_tokens, num_q_heads, HEAD_DIM, device="cuda").to(dtype)
        k, v = (torch.randn(num_tokens, num_kv_heads, HEAD_DIM, device="cuda").to(dtype) for _ in range(2))
    cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"), memory_format=torch.contiguous_format)
    scale = HEAD_DIM ** -0.5
    assert flash_prefill_ws(q, k, v, cu_seqlens, max(lengths), scale, out=out) is out
    err = rel_error(out, _reference(q, k, v, lengths, scale))
    assert err < tolerance(dtype), err


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("length", [1, 15, 16, 17, 127, 128, 129, 1000, 4096])
def test_single_sequence(length):
    torch.manual_seed(length)
    _check([length], 32, 8, torch.bfloat16)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(8, 8), (32, 8), (16, 2)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ragged_batch(num_q_heads, num_kv_heads, dtype):
    torch.manual_seed(1)
    _check([17, 4096, 1, 200, 15, 1000, 16], num_q_heads, num_kv_heads, dtype)


@pytest.mark.gpu
@needs_hopper
def test_every_tile_count_and_remainder():
    # 1..6 K/V tiles per query tile, sequence ends on, just past and inside a tile edge.
    torch.manual_seed(2)
    _check([128 * t + d for t in range(1, 7) for d in (0, 1, 64, 65)], 32, 8, torch.bfloat16)


@pytest.mark.gpu
@needs_hopper
def test_one_long_sequence_among_many_short_ones():
    # The persistent kernel deals work items over the SMs: many rounds, items of very
    # different weights, programs left without work.
    torch.manual_seed(5)
    _check([4096] + [128] * 40 + [1, 129, 255], 32, 8, torch.bfloat16)


@pytest.mark.gpu
@needs_hopper
def test_views_of_a_fused_qkv_output():
    torch.manual_seed(3)
    _check([300, 129], 32, 8, torch.bfloat16, fused=True)


@pytest.mark.gpu
@needs_hopper
def test_allocates_out_and_skips_empty_input():
    torch.manual_seed(4)
    q = torch.randn(5, 4, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(5, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu = torch.tensor([0, 5], dtype=torch.int32, device="cuda")
    assert rel_error(flash_prefill_ws(q, k, v, cu, 5, 0.1), _reference(q, k, v, [5], 0.1)) < 1e-2
    empty = flash_prefill_ws(q[:0], k[:0], v[:0], torch.zeros(1, dtype=torch.int32, device="cuda"), 0, 0.1)
    assert empty.shape == (0, 4, HEAD_DIM)


def test_support_is_hopper_half_precision_head_dim_128():
    assert not flash_prefill_ws_supported(torch.device("cpu"), torch.bfloat16, HEAD_DIM)
    if HOPPER:
        cuda = torch.device("cuda")
        assert flash_prefill_ws_supported(cuda, torch.bfloat16, 128)
        assert flash_prefill_ws_supported(cuda, torch.float16, 128)
        assert not flash_prefill_ws_supported(cuda, torch.float32, 128)
        assert not flash_prefill_ws_supported(cuda, torch.bfloat16, 64)


def test_unsupported_input_is_refused_by_name():
    q = torch.zeros(4, 2, 64)
    with pytest.raises(ValueError, match="head dim 128"):
        flash_prefill_ws(q, q[:, :1], q[:, :1], torch.tensor([0, 4], dtype=torch.int32), 4, 0.125)


def test_a_triton_without_this_gluon_keeps_the_triton_kernel(monkeypatch):
    """Gluon is experimental: if this Triton cannot import the kernel, the module still
    loads, says it is unsupported, and refuses by name (the engine keeps flash_prefill)."""
    import importlib
    import sys

    import kernels

    ws = importlib.import_module("kernels.flash_prefill_ws")  # the module (its function shadows it on `kernels`)

    monkeypatch.delattr(kernels, "_gluon_prefill_ws")
    monkeypatch.setitem(sys.modules, "kernels._gluon_prefill_ws", None)  # importing it fails
    try:
        importlib.reload(ws)
        assert ws._gluon is None
        assert not ws.flash_prefill_ws_supported(torch.device("cuda"), torch.bfloat16, HEAD_DIM)
        q = torch.zeros(4, 2, HEAD_DIM, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="Gluon"):
            ws.flash_prefill_ws(q, q[:, :1], q[:, :1], torch.tensor([0, 4], dtype=torch.int32), 4, 0.1)
    finally:
        monkeypatch.undo()
        importlib.reload(ws)
    assert ws._gluon is not None
