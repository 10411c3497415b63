"""The Hopper prefill kernel's two entry points against float64 references.

flash_prefill_ws (prompts without earlier context): one sequence around tile edges, ragged
packed batches (tiles that run past a sequence's end read the next one's K/V), GQA 1/4/8,
bf16 and fp16, views of a fused qkv output, a grid of a few programs.

flash_prefill_ws_paged (new tokens after context in the paged cache): context lengths
around tile edges, ragged batches with empty and one-token chunks, block sizes 16-128, GQA,
a grid of a few programs (many items per program: counters carried across items). Blocks
no sequence owns hold NaN and block-table entries past a sequence's end point far out of
range, so a read outside a sequence's own blocks fails.

Outputs start as NaN so an unwritten row fails. The kernel runs only on sm_90; without
one, the tests check that it refuses clearly."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels.flash_prefill_ws import flash_prefill_ws, flash_prefill_ws_paged, flash_prefill_ws_supported
from tests.kernels.reference import make_paged_kv, ref_paged_attention, rel_error, tolerance

COVERS = ("flash_prefill_ws", "flash_prefill_ws_paged", "flash_prefill_ws_supported")
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


def _check(lengths: list[int], num_q_heads: int, num_kv_heads: int, dtype: torch.dtype, fused: bool = False,
           max_programs: int | None = None) -> None:
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
    assert flash_prefill_ws(q, k, v, cu_seqlens, max(lengths), scale, out=out, max_programs=max_programs) is out
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
@pytest.mark.parametrize("programs", [1, 3])
def test_a_few_programs_run_many_items_each(programs):
    torch.manual_seed(6)
    _check([1000, 5, 129, 1, 300, 128, 17], 16, 4, torch.bfloat16, max_programs=programs)


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


def _check_paged(chunks: list[tuple[int, int]], num_q_heads: int = 32, num_kv_heads: int = 8, block_size: int = 16,
                 dtype: torch.dtype = torch.bfloat16, padding_rows: int = 0, max_programs: int | None = None) -> None:
    """chunks: (new tokens, earlier context) per sequence. Rows of q past the last
    sequence (padding) must stay unwritten."""
    q_lens = [n for n, _ in chunks]
    seq_lens = [n + c for n, c in chunks]
    kv = make_paged_kv(seq_lens, num_kv_heads, HEAD_DIM, block_size, dtype, "cuda")
    # The engine's pool starts zeroed and only ever holds K/V: slots of a sequence's last
    # block past its end are finite (the kernel reads whole blocks and masks them).
    for b, n in enumerate(seq_lens):
        if n % block_size:
            last = int(kv.block_tables[b, n // block_size])
            kv.k_cache[last, n % block_size:] = 0
            kv.v_cache[last, n % block_size:] = 0
    num_tokens = sum(q_lens)
    q = torch.randn(num_tokens + padding_rows, num_q_heads, HEAD_DIM, device="cuda").to(dtype)
    cu_seqlens = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    scale = HEAD_DIM ** -0.5
    got = flash_prefill_ws_paged(q, kv.k_cache, kv.v_cache, cu_seqlens, kv.seq_lens, kv.block_tables, scale,
                                 max(q_lens), out=out, max_programs=max_programs)
    assert got is out
    want = ref_paged_attention(q[:num_tokens], kv, q_lens, scale)
    assert rel_error(out[:num_tokens], want) < tolerance(dtype)
    for b, (start, n) in enumerate(zip(cu_seqlens.tolist(), q_lens)):  # no short sequence hides behind a long one
        if n:
            err = rel_error(out[start:start + n], want[start:start + n])
            assert err < tolerance(dtype), (b, chunks[b], err)
    assert out[num_tokens:].isnan().all()


# (new tokens, earlier context)
PAGED_SINGLE = [(1, 0), (17, 0), (128, 0), (1000, 0), (5, 20), (17, 3), (300, 1536), (129, 4000), (3000, 2047)]
PAGED_RAGGED = [(1000, 0), (5, 20), (129, 4000), (1, 0), (17, 3), (300, 1536), (0, 50), (128, 0), (17, 0),
                (300, 20), (1, 127), (1, 255), (64, 64)]
# The first query position at, just before and just past multiples of 128 (the masking rule).
PAGED_TILE_EDGES = [(1, 128), (128, 128), (256, 127), (130, 126), (129, 127), (255, 1), (384, 384), (2, 254)]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("chunk", PAGED_SINGLE, ids=[f"new{n}_ctx{c}" for n, c in PAGED_SINGLE])
def test_paged_single_sequence(chunk):
    torch.manual_seed(7)
    _check_paged([chunk])


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
def test_paged_ragged_batch(dtype, block_size):
    torch.manual_seed(8)
    _check_paged(PAGED_RAGGED, block_size=block_size, dtype=dtype, padding_rows=37)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(8, 8), (16, 2)])
def test_paged_gqa(num_q_heads, num_kv_heads):
    torch.manual_seed(9)
    _check_paged(PAGED_RAGGED, num_q_heads, num_kv_heads)


@pytest.mark.gpu
@needs_hopper
def test_paged_tile_edges():
    torch.manual_seed(10)
    _check_paged(PAGED_TILE_EDGES, 8, 2)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("programs,block_size,dtype", [(1, 16, torch.bfloat16), (3, 16, torch.bfloat16),
                                                       (2, 32, torch.float16)])
def test_paged_a_few_programs_run_many_items_each(programs, block_size, dtype):
    torch.manual_seed(11)
    _check_paged(PAGED_RAGGED + PAGED_TILE_EDGES, 8, 2, block_size, dtype, max_programs=programs)


def test_support_is_hopper_half_precision_head_dim_128():
    assert not flash_prefill_ws_supported(torch.device("cpu"), torch.bfloat16, HEAD_DIM)
    if HOPPER:
        cuda = torch.device("cuda")
        assert flash_prefill_ws_supported(cuda, torch.bfloat16, 128)
        assert flash_prefill_ws_supported(cuda, torch.float16, 128)
        assert not flash_prefill_ws_supported(cuda, torch.float32, 128)
        assert not flash_prefill_ws_supported(cuda, torch.bfloat16, 64)
        assert flash_prefill_ws_supported(cuda, torch.bfloat16, 128, block_size=16)
        assert not flash_prefill_ws_supported(cuda, torch.bfloat16, 128, block_size=8)


def test_unsupported_input_is_refused_by_name():
    q = torch.zeros(4, 2, 64)
    with pytest.raises(ValueError, match="head dim 128"):
        flash_prefill_ws(q, q[:, :1], q[:, :1], torch.tensor([0, 4], dtype=torch.int32), 4, 0.125)
    cache = torch.zeros(4, 8, 1, 64)
    lens = torch.tensor([4], dtype=torch.int32)
    with pytest.raises(ValueError, match="flash_prefill_ws_paged needs .* block size 16/32/64/128.*block size 8"):
        flash_prefill_ws_paged(q, cache, cache, torch.tensor([0, 4], dtype=torch.int32), lens,
                               torch.zeros(1, 1, dtype=torch.int32), 0.125, 4)


def test_a_triton_without_this_gluon_keeps_the_triton_kernel(monkeypatch):
    """Gluon is experimental: if this Triton cannot import the kernel, the module still
    loads, says it is unsupported, and refuses by name (the engine keeps flash_prefill)."""
    import importlib
    import sys

    from pdserve import kernels

    ws = importlib.import_module("pdserve.kernels.flash_prefill_ws")  # its function shadows it

    monkeypatch.delattr(kernels, "_gluon_prefill_ws")
    monkeypatch.setitem(sys.modules, "pdserve.kernels._gluon_prefill_ws", None)  # importing it fails
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
