"""launch_paged of the PERSISTENT kernel (v7 + paged mode, _gluon_prefill_ws.py next to
this file) against a float64 torch reference; also the contiguous `launch` of the same
module. Hopper only.

Run (from the repository root, with a time limit: a barrier mistake hangs):
    timeout 300 python -m pytest -q -o addopts="" -m gpu -x <this dir>/test_paged.py
(about 12 kernel compilations + a few seconds of float64 reference on an H100/H200)
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HOPPER, reason="needs a Hopper (sm_90) GPU")]

if HOPPER:
    import _gluon_prefill_ws as G
    from _gluon_prefill_ws import launch_paged
    assert os.path.dirname(os.path.abspath(G.__file__)) == os.path.dirname(os.path.abspath(__file__)), G.__file__

D = 128
DEV = "cuda"   # the float64 reference and the inputs (a CPU emulation of the kernel reuses them)
TOL = {torch.bfloat16: 1e-2, torch.float16: 5e-3}


def _build(pairs, num_q_heads, num_kv_heads, block_size, dtype, extra_tokens=0, seed=0):
    """pairs: [(q_len, ctx)]. Returns q, k_cache, v_cache, cu_seqlens_q, seq_lens,
    block_tables, and per-sequence contiguous K/V [seq_len, kv_heads, D] for the reference.
    Cache blocks no sequence owns and block-table entries past a sequence's last block
    point at / hold NaN, so any read outside a sequence's own blocks poisons the output."""
    dev = DEV
    g = torch.Generator(device=dev).manual_seed(seed)
    q_lens = [p[0] for p in pairs]
    seq_lens = [p[0] + p[1] for p in pairs]
    nblk = [(s + block_size - 1) // block_size for s in seq_lens]
    max_blocks = max(nblk) + 3
    spare = 7                                   # unowned blocks, NaN-filled
    num_blocks = sum(nblk) + spare
    perm = torch.randperm(num_blocks, device=dev, generator=g).to(torch.int32)
    owned, nan_blocks = perm[:sum(nblk)], perm[sum(nblk):]
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, D, device=dev, dtype=dtype, generator=g)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, D, device=dev, dtype=dtype, generator=g)
    k_cache[nan_blocks.long()] = float("nan")
    v_cache[nan_blocks.long()] = float("nan")
    # Garbage past each sequence's last block: the NaN blocks.
    bt = nan_blocks[torch.randint(0, spare, (len(pairs), max_blocks), device=dev, generator=g)].clone()
    ks, vs, off = [], [], 0
    for b, n in enumerate(nblk):
        bt[b, :n] = owned[off:off + n]
        off += n
        idx = bt[b, :n].long()
        ks.append(k_cache[idx].reshape(n * block_size, num_kv_heads, D)[:seq_lens[b]])
        vs.append(v_cache[idx].reshape(n * block_size, num_kv_heads, D)[:seq_lens[b]])
    total = sum(q_lens)
    q = torch.randn(total + extra_tokens, num_q_heads, D, device=dev, dtype=dtype, generator=g)
    cu = torch.zeros(len(pairs) + 1, dtype=torch.int32, device=dev)
    cu[1:] = torch.tensor(q_lens, device=dev).cumsum(0)
    return q, k_cache, v_cache, cu, torch.tensor(seq_lens, dtype=torch.int32, device=dev), bt, ks, vs


def _reference(q, cu, seq_lens, ks, vs, scale):
    """float64 causal attention; query i of sequence b sits at position ctx_b + i."""
    num_q_heads = q.shape[1]
    out = torch.full(q.shape, float("nan"), dtype=torch.float64, device=q.device)
    cu_l, sl_l = cu.tolist(), seq_lens.tolist()
    for b in range(len(sl_l)):
        q0, q1, s = cu_l[b], cu_l[b + 1], sl_l[b]
        ql = q1 - q0
        if ql == 0:
            continue
        ctx = s - ql
        group = num_q_heads // ks[b].shape[1]
        k = ks[b].double().repeat_interleave(group, dim=1).transpose(0, 1)   # [H, s, D]
        v = vs[b].double().repeat_interleave(group, dim=1).transpose(0, 1)
        qq = q[q0:q1].double().transpose(0, 1)                              # [H, ql, D]
        pos = ctx + torch.arange(ql, device=q.device)
        keep = torch.arange(s, device=q.device)[None, :] <= pos[:, None]      # [ql, s]
        for h0 in range(0, num_q_heads, 8):                                   # bound the score memory
            sc = (qq[h0:h0 + 8] @ k[h0:h0 + 8].transpose(1, 2)) * scale
            sc = sc.masked_fill(~keep, float("-inf"))
            out[q0:q1, h0:h0 + 8] = (torch.softmax(sc, dim=-1) @ v[h0:h0 + 8]).transpose(0, 1)
    return out


def _check(pairs, num_q_heads=32, num_kv_heads=8, block_size=16, dtype=torch.bfloat16, extra_tokens=0,
           max_programs=None):
    q, kc, vc, cu, sl, bt, ks, vs = _build(pairs, num_q_heads, num_kv_heads, block_size, dtype, extra_tokens)
    scale = D ** -0.5
    out = torch.full_like(q, float("nan"))
    saved, G._MAX_PROGRAMS = G._MAX_PROGRAMS, max_programs
    try:
        launch_paged(q, kc, vc, cu, sl, bt, scale, max(p[0] for p in pairs), out)
        torch.cuda.synchronize()
    finally:
        G._MAX_PROGRAMS = saved
    ref = _reference(q, cu, sl, ks, vs, scale)
    n = int(cu[-1])
    got, want = out[:n].double(), ref[:n]
    nan_rows = torch.isnan(got).any(-1).any(-1).nonzero().flatten()[:10].tolist()
    assert not nan_rows, f"NaN in output rows: {nan_rows}"
    err = float((got - want).norm() / want.norm())
    assert err < TOL[dtype], f"rel err {err:.3e} for {pairs} ({num_q_heads}/{num_kv_heads}, bs {block_size}, {dtype})"
    # Per-sequence too, so one short sequence cannot hide behind a long one.
    cu_l = cu.tolist()
    for b in range(len(pairs)):
        a, z = cu_l[b], cu_l[b + 1]
        if z > a:
            e = float((got[a:z] - want[a:z]).norm() / want[a:z].norm())
            assert e < TOL[dtype], f"seq {b} {pairs[b]}: rel err {e:.3e}"
    if extra_tokens:   # rows no sequence owns are never written
        assert torch.isnan(out[n:]).all()


# (q_len, context)
CASES = [(1, 0), (17, 0), (128, 0), (1000, 0), (5, 20), (17, 3), (300, 1536), (129, 4000), (3000, 2047)]
RAGGED = [(1000, 0), (5, 20), (129, 4000), (1, 0), (17, 3), (300, 1536), (0, 50), (128, 0), (17, 0), (300, 20),
          (1, 127), (1, 255), (64, 64)]


@pytest.mark.parametrize("pair", CASES, ids=[f"q{a}_ctx{b}" for a, b in CASES])
def test_single(pair):
    _check([pair])


def test_ragged_with_padding_rows():
    _check(RAGGED, extra_tokens=37)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_dtype_block_size(dtype, block_size):
    _check(RAGGED, block_size=block_size, dtype=dtype)


@pytest.mark.parametrize("heads", [(8, 8), (16, 2)], ids=["8-8", "16-2"])
def test_gqa(heads):
    _check(RAGGED, num_q_heads=heads[0], num_kv_heads=heads[1])


def test_gqa_fp16_bs32():
    _check([(300, 1536), (17, 3), (3000, 2047)], num_q_heads=16, num_kv_heads=2, block_size=32, dtype=torch.float16)


# Tile-boundary cases of the masking rule (P = ctx + q_first at / around multiples of 128).
EDGES = [(1, 128), (128, 128), (256, 127), (130, 126), (129, 127), (255, 1), (384, 384), (2, 254)]


def test_tile_edges():
    _check(EDGES, num_q_heads=8, num_kv_heads=2)


# The persistent scheduler with few programs: many items per program (carried tile / item /
# event counters, both Q slots reused many times, ring phases across items).
@pytest.mark.parametrize("programs", [1, 3, 7])
def test_few_programs(programs):
    _check(RAGGED, num_q_heads=8, num_kv_heads=2, max_programs=programs)


def test_few_programs_bs32_fp16():
    _check(EDGES + [(300, 1536), (17, 3)], num_q_heads=4, num_kv_heads=4, block_size=32, dtype=torch.float16,
           max_programs=2)


@pytest.mark.parametrize("programs", [None, 2])
def test_contiguous_launch(programs):
    """The contiguous path of the same module (fresh prompts: ctx 0) against the reference."""
    pairs = [(1000, 0), (5, 0), (129, 0), (1, 0), (300, 0), (128, 0), (0, 0), (17, 0)]
    q, kc, vc, cu, sl, bt, ks, vs = _build(pairs, 16, 4, 16, torch.bfloat16)
    k = torch.cat(ks).contiguous()
    v = torch.cat(vs).contiguous()
    scale = D ** -0.5
    out = torch.full_like(q, float("nan"))
    saved, G._MAX_PROGRAMS = G._MAX_PROGRAMS, programs
    try:
        G.launch(q, k, v, cu, max(p[0] for p in pairs), scale, out)
        torch.cuda.synchronize()
    finally:
        G._MAX_PROGRAMS = saved
    ref = _reference(q, cu, sl, ks, vs, scale)
    n = int(cu[-1])
    err = float((out[:n].double() - ref[:n]).norm() / ref[:n].norm())
    assert err < TOL[torch.bfloat16], err
