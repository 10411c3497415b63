"""Multi-head latent attention (MLA, DeepSeek-V2/V3) decode over the paged latent cache, in
the absorbed form: one query token per sequence, or a few (speculative verification's K + 1,
causal among them), split-K over the context.

A token's cache entry is one latent row of kv_lora_rank + rope_dim values (DeepSeek-V3:
512 + 64): the compressed, normalised c_kv, then the rotated k_pe. With W_UK folded into the
query (q_nope_absorbed = q_nope @ W_UK, by the caller) every head's key is that row and its
value the row's c_kv part:

    score = q_nope_absorbed . c_kv + q_pe . k_pe,    out = softmax(score * scale) @ c_kv

and the caller multiplies out (kv_lora_rank wide) by W_UV. So all heads of a sequence read
the same rows: the kernel is bound by the latent bytes it reads, and each program takes a
block of BLOCK_H heads (and, verifying, all of the sequence's new tokens: rows are
(token, head) pairs, FlashMLA's folding of the query length into the heads) so that every
latent tile loaded feeds BLOCK_R rows' dots. The tile is loaded once, [BLOCK_N, rank] plus
[BLOCK_N, rope], and enters both the score dot (transposed) and the value dot. Programs of
one sequence's head blocks are adjacent in the grid (axis 0), so that they run together and
the second to read a tile finds it in L2: DRAM sees the latent once, L2 sees it once per
head block (FlashMLA holds 64 heads a CTA for this; vLLM's and SGLang's Triton kernels 16,
loading the tile twice, as K and as V).

A long context is cut into `num_splits` slices run by separate programs; each writes its
unnormalised partial output, running max and sum into a float32 workspace that
`split_merge`'s merge kernel reduces (its layout: [rows, heads, splits, rank + 2]).

An FP8 (e4m3) latent cache is widened as loaded (to float16 beside a bfloat16 query,
`fp8.dot_dtype`), with no scale (`kernels.fp8`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels import _pdl, fp8
from pdserve.kernels.split_merge import decode_workspace, merge_splits, workspace_args
from pdserve.kernels.split_merge import num_sms as _num_sms  # patched here by tests planning another card

LOG2E = 1.4426950408889634
# The shortest split: one 32-token tile, and no fewer tokens than twice the heads, so that a
# split's workspace rows (heads x (rank + 2) floats, written and read back: ~1.8 latent
# tokens' bytes a head) cost no more than the latents it reads. 256 at 128 heads; 32 at 16,
# where one sequence of 1k ran in 6.7 us at 32 splits against 19.0 at 4 (H100,
# benchmarks/RESULTS.md).
_MIN_SPLIT_TOKENS = 32
# The merge kernel holds [splits, rank] floats a program: 32 x 512 is 64 KB of registers.
_MAX_SPLITS = 32
# Rows (tokens x heads) a program's [rows, rank] float32 accumulator holds on the GPU: 64
# x 512 is 128 registers a thread over 8 warps, FlashMLA's 64 heads a CTA.
_GPU_ROWS = 64


@triton.jit
def _load_tile(cache_ptr, bt_row, n0, end, KV_RANK: tl.constexpr, ROPE_DIM: tl.constexpr,
               PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys n0 .. n0 + BLOCK_N - 1 of one sequence: their positions, which are < end, and
    their latent rows split in two: c_kv [BLOCK_N, KV_RANK] and k_pe [BLOCK_N, ROPE_DIM]
    (zeros past end)."""
    pos = n0 + tl.arange(0, BLOCK_N)
    valid = pos < end
    block_ids = tl.load(bt_row + pos // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
    rows = (block_ids * PAGE_SIZE + pos % PAGE_SIZE) * (KV_RANK + ROPE_DIM)
    c_kv = tl.load(cache_ptr + rows[:, None] + tl.arange(0, KV_RANK)[None, :], mask=valid[:, None], other=0.0)
    k_pe = tl.load(cache_ptr + rows[:, None] + KV_RANK + tl.arange(0, ROPE_DIM)[None, :],
                   mask=valid[:, None], other=0.0)
    return pos, valid, c_kv, k_pe


@triton.jit
def _update(q_nope, q_pe, c_kv, k_pe, pos, valid, last_key, scale_log2, m_i, l_i, acc,
            DOT_PRECISION: tl.constexpr, CAUSAL: tl.constexpr):
    """One latent tile into the online softmax of the rows [R, rank] (running max in base 2,
    sum, unnormalised output [R, rank]). CAUSAL: row r sees keys <= last_key[r] only."""
    c_kv, k_pe = c_kv.to(q_nope.dtype), k_pe.to(q_pe.dtype)  # an FP8 tile, widened
    s = tl.dot(q_nope, tl.trans(c_kv), input_precision=DOT_PRECISION)
    s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision=DOT_PRECISION)   # [R, BLOCK_N]
    if CAUSAL:
        s = tl.where(valid[None, :] & (pos[None, :] <= last_key[:, None]), s, float("-inf"))
    else:
        s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
    # A row may see no key of a tile (verifying: a split past its position): 0, not NaN.
    m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.math.exp2(m_i - m_ref)
    p = tl.math.exp2(s * scale_log2 - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(c_kv.dtype), c_kv, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# stride_bt (a table row's blocks) changes between eager steps: unspecialized, no compiles.
@triton.jit(do_not_specialize=["stride_bt"])
def _mla_split_kernel(
    q_nope_ptr,         # [num_tokens, num_heads, kv_lora_rank]
    q_pe_ptr,           # [num_tokens, num_heads, rope_dim]
    cache_ptr,          # [num_blocks, block_size, kv_lora_rank + rope_dim]
    block_tables_ptr,   # [num_seqs, max_blocks_per_seq] int32
    cu_seqlens_ptr,     # [num_seqs + 1] int32 when VERIFY: sequence b's tokens are cu[b] .. cu[b + 1] - 1
    seq_lens_ptr,       # [num_seqs] int32, new tokens included
    out_ptr,            # [num_tokens, num_heads, kv_lora_rank], written when NUM_SPLITS == 1
    ws_ptr,             # [>=num_tokens, num_heads, num_splits, kv_lora_rank + 2] fp32, else
    scale_log2,         # softmax scale * log2(e): the kernel works in base 2
    stride_nt, stride_nh, stride_pt, stride_ph, stride_bt, stride_ot, stride_oh,
    stride_wt, stride_wh, stride_ws,
    num_heads,
    KV_RANK: tl.constexpr, ROPE_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    VERIFY: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    """Row r of a program is token r // BLOCK_H of its sequence (0 when not VERIFY) and head
    head_block * BLOCK_H + r % BLOCK_H; token t sits at position seq_len - q_len + t."""
    head_block = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    _pdl.wait(PDL)
    if VERIFY:
        q_start = tl.load(cu_seqlens_ptr + seq)
        q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    else:
        q_start = seq
        q_len = 1
    seq_len = tl.load(seq_lens_ptr + seq)
    # Equal whole tiles per split, so that no split waits on a longer one.
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), NUM_SPLITS)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)

    offs_r = tl.arange(0, BLOCK_R)
    tok = offs_r // BLOCK_H
    heads = head_block * BLOCK_H + offs_r % BLOCK_H
    mask_r = (tok < q_len) & (heads < num_heads)
    token_rows = (q_start + tok).to(tl.int64)
    offs_c = tl.arange(0, KV_RANK)
    q_nope = tl.load(q_nope_ptr + token_rows[:, None] * stride_nt + heads[:, None] * stride_nh + offs_c[None, :],
                     mask=mask_r[:, None], other=0.0)                      # [BLOCK_R, KV_RANK]
    q_pe = tl.load(q_pe_ptr + token_rows[:, None] * stride_pt + heads[:, None] * stride_ph
                   + tl.arange(0, ROPE_DIM)[None, :], mask=mask_r[:, None], other=0.0)
    # Beside an FP8 cache a bfloat16 query multiplies as float16 (`fp8.dot_dtype`; one
    # element of the cache read for its dtype).
    q_nope = fp8.dot_dtype(q_nope, tl.load(cache_ptr))
    q_pe = fp8.dot_dtype(q_pe, tl.load(cache_ptr))
    last_key = seq_len - q_len + tok

    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, KV_RANK], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos, valid, c_kv, k_pe = _load_tile(cache_ptr, bt_row, n0, end, KV_RANK, ROPE_DIM, PAGE_SIZE, BLOCK_N)
        m_i, l_i, acc = _update(q_nope, q_pe, c_kv, k_pe, pos, valid, last_key, scale_log2, m_i, l_i, acc,
                                DOT_PRECISION, VERIFY)

    if NUM_SPLITS == 1:
        # A row that saw no key (seq_len 0: a padded CUDA-graph row) has l_i = 0: zeros, not NaN.
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        out_rows = out_ptr + token_rows * stride_ot + heads * stride_oh
        tl.store(out_rows[:, None] + offs_c[None, :], o.to(out_ptr.dtype.element_ty), mask=mask_r[:, None])
    else:
        ws_rows = ws_ptr + token_rows * stride_wt + heads * stride_wh + split * stride_ws
        tl.store(ws_rows[:, None] + offs_c[None, :], acc, mask=mask_r[:, None])
        tl.store(ws_rows + KV_RANK, m_i, mask=mask_r)
        tl.store(ws_rows + KV_RANK + 1, l_i, mask=mask_r)


def mla_decode_num_splits(num_seqs: int, num_heads: int, block_h: int, max_context_len: int,
                          device: torch.device, max_seqlen_q: int = 1) -> int:
    """Split count the launcher picks when given none (host arithmetic, no sync): one once the
    programs (sequences x head blocks) fill the multiprocessors; else as many as fit in one
    wave of the programs the multiprocessors hold at once (`_programs_per_sm`), rounded down:
    a wave and a fifth ran as two (16 heads, 64 x 4k on an H100: 5 splits 63% of copy, 4
    splits 85%, benchmarks/RESULTS.md); never splits shorter than _MIN_SPLIT_TOKENS or twice
    the heads, nor more than _MAX_SPLITS."""
    num_sms = _num_sms(device)
    programs = num_seqs * triton.cdiv(num_heads, block_h)
    if programs >= num_sms:
        return 1
    want = _programs_per_sm(block_h * triton.next_power_of_2(max_seqlen_q)) * num_sms // programs
    shortest = max(_MIN_SPLIT_TOKENS, 2 * num_heads)
    return max(1, min(want, max_context_len // shortest, _MAX_SPLITS))


def _programs_per_sm(rows: int) -> int:
    """Programs of `rows` rows (tokens x heads) a multiprocessor holds at once in bf16: one of
    _GPU_ROWS (two 64-token tiles in flight and the query, ~216 KB of shared memory), two of
    fewer (32-token tiles, ~90 KB)."""
    return 1 if rows >= _GPU_ROWS else 2


def mla_decode_default_splits(num_seqs: int, num_heads: int, max_context_len: int, dtype: torch.dtype,
                              device: torch.device, max_seqlen_q: int = 1) -> int:
    """The split count `mla_decode` launches with when given neither a workspace nor
    num_splits, for queries of `dtype` over a block table of max_context_len tokens: what a
    CUDA graph captured over such a table fixes (`engine/runner/cuda_graphs.py`)."""
    block_h = mla_decode_tiling(torch.empty(0, dtype=dtype, device=device), num_heads, max_seqlen_q)["block_h"]
    return mla_decode_num_splits(num_seqs, num_heads, block_h, max_context_len, device, max_seqlen_q)


def mla_decode_tiling(q: torch.Tensor, num_heads: int, max_seqlen_q: int) -> dict[str, int]:
    """Default block_h (heads a program), block_n (tokens a latent tile), num_warps,
    num_stages. GPU: _GPU_ROWS rows (tokens x heads) a program over 8 warps, two 64-token
    tiles in flight (~216 KB of shared memory with the query at rank 512, bf16): the two
    warpgroups split the score dot's N (the tile's tokens), so 64 tokens give each a wgmma
    32 wide, not 16, and the output is rescaled once per 64 tokens (at 128 heads 1.30-1.41x
    the 32-token tile on an H200, benchmarks/RESULTS.md); fewer rows keep 4 warps and
    32-token tiles. float32 rows and tiles smaller (twice the bytes). CPU (interpreter): the
    least tl.dot takes."""
    q_block = triton.next_power_of_2(max(max_seqlen_q, 1))
    if not q.is_cuda:
        return {"block_h": max(1, min(triton.next_power_of_2(num_heads), 16 // q_block)), "block_n": 16,
                "num_warps": 4, "num_stages": 1}
    rows = 16 if q.element_size() > 2 else _GPU_ROWS
    block_h = max(1, min(triton.next_power_of_2(num_heads), rows // q_block))
    big = block_h * q_block >= 64
    return {"block_h": block_h, "block_n": 16 if q.element_size() > 2 else (64 if big else 32),
            "num_warps": 8 if big else 4, "num_stages": 2}


def _check_inputs(q_nope: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, scale: float) -> None:
    num_tokens, num_heads, kv_lora_rank = q_nope.shape
    rope_dim = q_pe.shape[2]
    assert q_pe.shape[:2] == (num_tokens, num_heads), (q_nope.shape, q_pe.shape)
    assert latent_cache.dim() == 3 and latent_cache.shape[2] == kv_lora_rank + rope_dim, (
        f"latent_cache [num_blocks, block_size, kv_lora_rank + rope_dim] = {kv_lora_rank} + {rope_dim}, "
        f"got {tuple(latent_cache.shape)}")
    assert q_nope.dtype == q_pe.dtype and q_nope.dtype in (torch.float16, torch.bfloat16, torch.float32)
    fp8.check_cache_dtype(q_nope.dtype, latent_cache.dtype)
    assert latent_cache.is_contiguous() and q_nope.stride(-1) == 1 and q_pe.stride(-1) == 1
    for name, dim in (("kv_lora_rank", kv_lora_rank), ("rope_dim", rope_dim)):
        assert dim >= 16 and dim & (dim - 1) == 0, f"{name} must be a power of two >= 16, got {dim}"
    assert scale > 0, "the kernel folds the scale into a running max"
    assert block_tables.dtype == seq_lens.dtype == torch.int32 and block_tables.stride(1) == 1
    assert seq_lens.dim() == 1 and block_tables.shape[0] == seq_lens.shape[0]


def mla_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    cu_seqlens_q: torch.Tensor | None = None,
    max_seqlen_q: int = 1,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    num_splits: int | None = None,
    **tuning: int,
) -> torch.Tensor:
    """Absorbed MLA attention of new query tokens over their sequences' paged latent cache
    (the module's docstring); the output stays in the latent space.

    Args:
        q_nope: [num_tokens, num_heads, kv_lora_rank], the no-rope query already multiplied
            by W_UK; last dim contiguous (fp16, bf16 or fp32).
        q_pe: [num_tokens, num_heads, rope_dim], the rotated query part, q_nope's dtype; last
            dim contiguous (a view of a wider projection output is fine).
        latent_cache: [num_blocks, block_size, kv_lora_rank + rope_dim], contiguous (one
            layer of the pool [layers, 1, blocks, block_size, 1, latent]): c_kv then k_pe per
            token, q's dtype or float8_e4m3fn. Every position of each sequence there, its new
            tokens' too.
        block_tables: [num_seqs, max_blocks_per_seq] int32.
        seq_lens: [num_seqs] int32 keys per sequence, its new tokens included (0 = a padding
            row: zeros out).
        scale: softmax scale (DeepSeek: qk_head_dim ** -0.5, times YaRN's mscale squared).
        cu_seqlens_q: None: one token per sequence (num_tokens == num_seqs) at position
            seq_lens[b] - 1. Given ([num_seqs + 1] int32 offsets of each sequence's tokens in
            q, verification): token i of sequence b sits at position seq_lens[b] - q_len_b + i
            and sees keys up to it.
        max_seqlen_q: host int >= every q_len (1 without cu_seqlens_q); sizes the rows.
        out: optional preallocated [num_tokens, num_heads, kv_lora_rank] in q's dtype.
        workspace: optional float32 [>=num_tokens, num_heads, num_splits, kv_lora_rank + 2]
            (`split_merge.decode_workspace(num_tokens, num_heads, kv_lora_rank, splits)`);
            its shape[2] is the split count. Give it (or num_splits=1) to make the launch
            allocation-free and CUDA-graph-safe.
        num_splits: split count when no workspace is given; default `mla_decode_num_splits`
            over the context block_tables can hold.
        tuning: block_h (heads a program, a power of two), block_n (tokens a tile, >= 16),
            num_warps, num_stages; defaults `mla_decode_tiling`.

    Returns:
        out.
    """
    _check_inputs(q_nope, q_pe, latent_cache, block_tables, seq_lens, scale)
    num_tokens, num_heads, kv_lora_rank = q_nope.shape
    num_seqs, page_size = seq_lens.shape[0], latent_cache.shape[1]
    verify = cu_seqlens_q is not None
    if verify:
        assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q.shape == (num_seqs + 1,)
        assert max_seqlen_q >= 1, "max_seqlen_q sizes the rows: at least 1"
    elif max_seqlen_q != 1 or num_tokens != num_seqs:
        raise ValueError(f"without cu_seqlens_q, mla_decode takes one token per sequence: got {num_tokens} "
                         f"tokens for {num_seqs} sequences, max_seqlen_q={max_seqlen_q}")
    if out is None:
        out = torch.empty_like(q_nope)
    assert out.shape == q_nope.shape and out.dtype == q_nope.dtype and out.stride(-1) == 1
    config = mla_decode_tiling(q_nope, num_heads, max_seqlen_q) | tuning
    block_h, block_n = config["block_h"], config["block_n"]
    assert block_h >= 1 and block_h & (block_h - 1) == 0 and block_n >= 16 and block_n & (block_n - 1) == 0, config
    if workspace is not None:
        num_splits = workspace.shape[2]
        assert workspace.dtype == torch.float32 and workspace.stride(-1) == 1
        assert workspace.shape[0] >= num_tokens and workspace.shape[1:] == (num_heads, num_splits, kv_lora_rank + 2)
    elif num_splits is None:
        num_splits = mla_decode_num_splits(num_seqs, num_heads, block_h, block_tables.shape[1] * page_size,
                                           q_nope.device, max_seqlen_q)
    if num_splits > 1 and workspace is None:
        workspace = decode_workspace(num_tokens, num_heads, kv_lora_rank, num_splits, q_nope.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    ws, ws_strides = workspace_args(workspace, out)
    pdl = _pdl.pdl(q_nope)
    # tl.dot needs at least 16 rows: a small block of heads (or tokens) is padded.
    block_r = max(16, block_h * triton.next_power_of_2(max_seqlen_q))
    _mla_split_kernel[(triton.cdiv(num_heads, block_h), num_seqs, num_splits)](
        q_nope, q_pe, latent_cache, block_tables, cu_seqlens_q, seq_lens, out, ws, scale * LOG2E,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1), *ws_strides, num_heads,
        KV_RANK=kv_lora_rank, ROPE_DIM=q_pe.shape[2], PAGE_SIZE=page_size, BLOCK_H=block_h, BLOCK_R=block_r,
        BLOCK_N=block_n, NUM_SPLITS=num_splits, VERIFY=verify,
        DOT_PRECISION="ieee" if q_nope.dtype == torch.float32 else "tf32", PDL=pdl,
        num_warps=config["num_warps"], num_stages=config["num_stages"], launch_pdl=pdl,
    )
    if num_splits > 1:
        merge_splits(workspace, out, num_tokens, ws_strides)
    return out
