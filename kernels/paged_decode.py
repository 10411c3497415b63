"""Paged-attention decode: one query token per sequence (`paged_decode`), or a few
(`paged_verify`: speculative verification's K + 1 tokens), split-K over the context.

Each program takes one (sequence, KV head, split): the query heads of that KV group (and,
in `paged_verify`, the sequence's new tokens too) share every K/V tile it loads, and a
long context is cut into `num_splits` slices run by separate programs so that batch 1
still fills the GPU (flash-decoding). With several splits, each writes its unnormalised
partial output plus its running max and sum into a float32 workspace and a second kernel
merges them.

Over an FP8 cache the K/V tiles are widened to the query's dtype before the dots (exact), or
with `fp8_dot` (opt-in: it changes outputs) multiplied as e4m3: the query rounded to e4m3
with a scale per (token, head) (`fp8.quantize_rows`), the softmax probabilities P rounded to
e4m3 with scale 1 (they lie in [0, 1]; FlashAttention-3's FP8 mode does the same), both dots
accumulating in float32. K and V carry no scale (`kernels.fp8`), so none is applied.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from pdserve.kernels import _pdl, fp8
from pdserve.kernels.split_merge import decode_workspace, merge_splits, workspace_args
from pdserve.kernels.split_merge import num_sms as _num_sms  # patched here by tests planning another card

LOG2E = 1.4426950408889634
_MIN_TOKENS_PER_SPLIT = 128  # a shorter split costs more in launch and merge than it gains
_MAX_SPLITS = 128
# Past this many tokens per split, fewer and longer splits did better (8 x 32k on the H200).
_LONG_SPLIT_TOKENS = 2048
_MID_BATCH_HEAD_DIM = 128  # one split of 128-key tiles at mid batches: measured at this head dim
_FP8_DOT_MIN_K = 32  # least reduction of an 8-bit tl.dot (Triton NVIDIA backend's min_dot_size)


@triton.jit
def _split_range(seq_len, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """Keys [start, end) of this program's split: equal whole tiles per split, so that no
    split waits on a longer one."""
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    start = tl.program_id(2) * tiles_per_split * BLOCK_N
    return start, tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)


@triton.jit
def _tile_offsets(bt_row, kv_head, n0, end, row_stride,
                  HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys n0 .. n0 + BLOCK_N - 1 of one sequence: their positions, which are < end, and
    their rows' offsets [BLOCK_N, D] in the paged cache (one KV head)."""
    offs_d = tl.arange(0, HEAD_DIM)
    pos = n0 + tl.arange(0, BLOCK_N)
    valid = pos < end
    block_ids = tl.load(bt_row + pos // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
    rows = (block_ids * PAGE_SIZE + pos % PAGE_SIZE) * row_stride + kv_head * HEAD_DIM
    return pos, valid, rows[:, None] + offs_d[None, :]


@triton.jit
def _first_tile(k_cache_ptr, v_cache_ptr, bt_row, kv_head, start, end, first_new, row_stride,
                HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
                READ_AHEAD: tl.constexpr):
    """The split's first K/V tile. With READ_AHEAD it is read across the PDL wait (`_pdl`):
    keys before the step's new tokens (first_new on) were written by earlier steps, so they
    are read while the kernel before this one (which writes the new tokens' K/V, and q)
    finishes; the new tokens' rows are read again after it has (the kernel has waited
    already without READ_AHEAD). Returns what `_update` takes."""
    pos, valid, kv_offs = _tile_offsets(bt_row, kv_head, start, end, row_stride, HEAD_DIM, PAGE_SIZE, BLOCK_N)
    k = tl.load(k_cache_ptr + kv_offs, mask=valid[:, None], other=0.0)
    v = tl.load(v_cache_ptr + kv_offs, mask=valid[:, None], other=0.0)
    if READ_AHEAD:
        _pdl.wait(PDL)
        fresh = (valid & (pos >= first_new))[:, None]
        k = tl.load(k_cache_ptr + kv_offs, mask=fresh, other=k)
        v = tl.load(v_cache_ptr + kv_offs, mask=fresh, other=v)
    return pos, valid, k, v


@triton.jit
def _query_operand(q, k0, FP8_DOT: tl.constexpr):
    """q [R, D] as the dots take it beside K tiles like k0, and its rows' scales: e4m3 rows
    and a scale per row with FP8_DOT (`fp8.quantize_rows`), else `fp8.dot_dtype`'s q and 1."""
    if FP8_DOT:
        return fp8.quantize_rows(q)
    else:
        return fp8.dot_dtype(q, k0), 1.0


@triton.jit
def _update(q, q_scale, k, v, pos, valid, last_key, scale_log2, m_i, l_i, acc,
            DOT_PRECISION: tl.constexpr, CAUSAL: tl.constexpr, FP8_DOT: tl.constexpr):
    """One K/V tile [BLOCK_N, D] into the online softmax of q's rows [R, D] (running max in
    base 2, sum, unnormalised output). FP8_DOT: q holds e4m3 rows scaled by q_scale [R]
    (`_query_operand`), the e4m3 tile enters both dots as it is and P is rounded to e4m3
    (its sum l_i stays float32, as FlashAttention-3's); else an FP8 tile is widened to q's
    dtype."""
    if FP8_DOT:
        s = tl.dot(q, tl.trans(k)) * q_scale[:, None]
    else:
        k, v = k.to(q.dtype), v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if CAUSAL:
        s = tl.where(valid[None, :] & (pos[None, :] <= last_key[:, None]), s, float("-inf"))
    else:
        s = tl.where(valid[None, :], s, float("-inf"))                     # [BLOCK_R, BLOCK_N]
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
    if CAUSAL:
        # A row may see no key of a tile (a split past its position): keep it at 0, not NaN.
        m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)
    else:
        m_ref = m_new
    alpha = tl.math.exp2(m_i - m_ref)
    p = tl.math.exp2(s * scale_log2 - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP8_DOT:
        # to_e4m3, not a cast: the interpreter's cast rounds wrongly (`fp8.to_e4m3`).
        acc = acc * alpha[:, None] + tl.dot(fp8.to_e4m3(p), v)
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend(q, q_scale, pos0, valid0, k0, v0, k_cache_ptr, v_cache_ptr, bt_row, kv_head, start, end, last_key,
            scale_log2, row_stride, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
            DOT_PRECISION: tl.constexpr, CAUSAL: tl.constexpr, FP8_DOT: tl.constexpr):
    """Online softmax of q's rows [R, D] (with q_scale: `_query_operand`) over keys
    start .. end - 1 of one sequence's paged K/V (one KV head, block table row bt_row), the
    first tile given (pos0, valid0, k0, v0: `_first_tile`).
    CAUSAL: row r sees keys <= last_key[r] only (else every key: one query token at the
    sequence's end). Returns the running max (base 2), the sum and the unnormalised
    output [R, D]."""
    BLOCK_R: tl.constexpr = q.shape[0]
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, HEAD_DIM], tl.float32)
    if start < end:  # an empty split (past the sequence's end) sees no key
        m_i, l_i, acc = _update(q, q_scale, k0, v0, pos0, valid0, last_key, scale_log2, m_i, l_i, acc,
                                DOT_PRECISION, CAUSAL, FP8_DOT)
    for n0 in range(start + BLOCK_N, end, BLOCK_N):
        pos, valid, kv_offs = _tile_offsets(bt_row, kv_head, n0, end, row_stride, HEAD_DIM, PAGE_SIZE, BLOCK_N)
        k = tl.load(k_cache_ptr + kv_offs, mask=valid[:, None], other=0.0)
        v = tl.load(v_cache_ptr + kv_offs, mask=valid[:, None], other=0.0)
        m_i, l_i, acc = _update(q, q_scale, k, v, pos, valid, last_key, scale_log2, m_i, l_i, acc,
                                DOT_PRECISION, CAUSAL, FP8_DOT)
    return m_i, l_i, acc


@triton.jit
def _write_rows(out_rows, ws_rows, m_i, l_i, acc, mask, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """One split: the normalised rows into out (out_rows: each row's pointer), or with
    several, the partial output, max and sum into the workspace (ws_rows) for the merge."""
    offs_d = tl.arange(0, HEAD_DIM)
    if NUM_SPLITS == 1:
        # A row that saw no key (seq_len 0: a padded CUDA-graph row) has l_i = 0: zeros, not NaN.
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_rows[:, None] + offs_d[None, :], o.to(out_rows.dtype.element_ty), mask=mask[:, None])
    else:
        tl.store(ws_rows[:, None] + offs_d[None, :], acc, mask=mask[:, None])
        tl.store(ws_rows + HEAD_DIM, m_i, mask=mask)
        tl.store(ws_rows + HEAD_DIM + 1, l_i, mask=mask)


# stride_bt (a table row's blocks) changes between eager steps: unspecialized, no compiles.
@triton.jit(do_not_specialize=["stride_bt"])
def _decode_split_kernel(
    q_ptr,              # [batch, num_q_heads, head_dim]
    k_cache_ptr,        # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,        # same as k_cache
    block_tables_ptr,   # [batch, max_blocks_per_seq] int32
    seq_lens_ptr,       # [batch] int32
    out_ptr,            # [batch, num_q_heads, head_dim], written when NUM_SPLITS == 1
    ws_ptr,             # [>=batch, num_q_heads, num_splits, head_dim + 2] fp32, else
    scale_log2,         # softmax scale * log2(e): the kernel works in base 2
    stride_qb, stride_qh, stride_bt, stride_ob, stride_oh,
    stride_wb, stride_wh, stride_ws,
    row_stride,         # num_kv_heads * head_dim: one token's row in the cache
    QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr, READ_AHEAD: tl.constexpr,
    FP8_DOT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if not READ_AHEAD:
        _pdl.wait(PDL)
    seq_len = tl.load(seq_lens_ptr + seq)
    start, end = _split_range(seq_len, BLOCK_N, NUM_SPLITS)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    pos0, valid0, k0, v0 = _first_tile(k_cache_ptr, v_cache_ptr, bt_row, kv_head, start, end, seq_len - 1,
                                       row_stride, HEAD_DIM, PAGE_SIZE, BLOCK_N, PDL, READ_AHEAD)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * QUERIES_PER_KV + offs_g
    mask_g = offs_g < QUERIES_PER_KV
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None], other=0.0)                          # [BLOCK_G, D]
    q, q_scale = _query_operand(q, k0, FP8_DOT)
    m_i, l_i, acc = _attend(q, q_scale, pos0, valid0, k0, v0, k_cache_ptr, v_cache_ptr, bt_row, kv_head, start, end,
                            end, scale_log2, row_stride, HEAD_DIM, PAGE_SIZE, BLOCK_N, DOT_PRECISION, False, FP8_DOT)
    _write_rows(out_ptr + seq * stride_ob + heads * stride_oh,
                ws_ptr + seq.to(tl.int64) * stride_wb + heads * stride_wh + split * stride_ws,
                m_i, l_i, acc, mask_g, HEAD_DIM, NUM_SPLITS)


@triton.jit(do_not_specialize=["stride_bt"])
def _verify_split_kernel(
    q_ptr,              # [num_tokens, num_q_heads, head_dim], sequences' new tokens packed
    k_cache_ptr,        # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,        # same as k_cache
    block_tables_ptr,   # [batch, max_blocks_per_seq] int32
    cu_seqlens_ptr,     # [batch + 1] int32: sequence b's tokens are q[cu[b]:cu[b + 1]]
    seq_lens_ptr,       # [batch] int32, new tokens included
    out_ptr,            # [num_tokens, num_q_heads, head_dim], written when NUM_SPLITS == 1
    ws_ptr,             # [>=num_tokens, num_q_heads, num_splits, head_dim + 2] fp32, else
    scale_log2,         # softmax scale * log2(e)
    stride_qt, stride_qh, stride_bt, stride_ot, stride_oh,
    stride_wt, stride_wh, stride_ws,
    row_stride,         # num_kv_heads * head_dim
    QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr, READ_AHEAD: tl.constexpr,
    FP8_DOT: tl.constexpr,
):
    """_decode_split_kernel with rows (new token t, query head g of the KV group): row r is
    token r // QUERIES_PER_KV, head r % QUERIES_PER_KV; token t sits at position
    seq_len - q_len + t and sees keys up to it."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if not READ_AHEAD:
        _pdl.wait(PDL)
    q_start = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    start, end = _split_range(seq_len, BLOCK_N, NUM_SPLITS)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    pos0, valid0, k0, v0 = _first_tile(k_cache_ptr, v_cache_ptr, bt_row, kv_head, start, end, seq_len - q_len,
                                       row_stride, HEAD_DIM, PAGE_SIZE, BLOCK_N, PDL, READ_AHEAD)

    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, HEAD_DIM)
    tok = offs_r // QUERIES_PER_KV
    heads = kv_head * QUERIES_PER_KV + offs_r % QUERIES_PER_KV
    mask_r = tok < q_len
    token_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + token_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_r[:, None], other=0.0)                            # [BLOCK_R, D]
    q, q_scale = _query_operand(q, k0, FP8_DOT)
    m_i, l_i, acc = _attend(q, q_scale, pos0, valid0, k0, v0, k_cache_ptr, v_cache_ptr, bt_row, kv_head, start, end,
                            seq_len - q_len + tok, scale_log2, row_stride, HEAD_DIM, PAGE_SIZE, BLOCK_N,
                            DOT_PRECISION, True, FP8_DOT)
    _write_rows(out_ptr + token_rows * stride_ot + heads * stride_oh,
                ws_ptr + token_rows * stride_wt + heads * stride_wh + split * stride_ws,
                m_i, l_i, acc, mask_r, HEAD_DIM, NUM_SPLITS)


def decode_num_splits(batch: int, num_kv_heads: int, head_dim: int, max_context_len: int,
                      device: torch.device) -> int:
    """Split count the launchers pick when given none (host arithmetic, no sync): one when the
    batch alone gives a program per multiprocessor (two below head dim 128); else about four
    programs per multiprocessor, or two where splits would pass _LONG_SPLIT_TOKENS; never
    splits shorter than _MIN_TOKENS_PER_SPLIT. Fitted to the H200 (benchmarks/RESULTS.md)."""
    num_sms = _num_sms(device)
    programs = batch * num_kv_heads
    if programs >= (num_sms if head_dim >= _MID_BATCH_HEAD_DIM else 2 * num_sms):
        return 1
    want = triton.cdiv(4 * num_sms, programs)
    if max_context_len // want > _LONG_SPLIT_TOKENS:
        want = triton.cdiv(2 * num_sms, programs)
    return max(1, min(want, max_context_len // _MIN_TOKENS_PER_SPLIT, _MAX_SPLITS))


def _check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, fp8_dot: bool) -> None:
    """What both launchers need of q [rows, num_q_heads, head_dim] and the paged cache; with
    fp8_dot, e4m3 tiles to multiply and a head_dim of at least 32 (Triton's least reduction
    for 8-bit dots; the tiles' block_n too, `_FP8_DOT_MIN_K`)."""
    num_q_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    assert k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim, (k_cache.shape, q.shape)
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32) and k_cache.dtype == v_cache.dtype
    fp8.check_cache_dtype(q.dtype, k_cache.dtype)
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(-1) == 1
    assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
    assert scale > 0, "the kernel folds the scale into a running max"
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, f"head_dim must be a power of two >= 16, got {head_dim}"
    if fp8_dot and k_cache.dtype != fp8.KV_FP8:
        raise ValueError(f"fp8_dot multiplies the cache's e4m3 tiles as they are: it needs an FP8 "
                         f"(float8_e4m3fn) KV cache, got {k_cache.dtype}")
    assert not fp8_dot or head_dim >= _FP8_DOT_MIN_K, f"fp8_dot needs head_dim >= 32, got {head_dim}"


def _default_tiling(q: torch.Tensor, k_cache: torch.Tensor, programs: int, num_splits: int,
                    fp8_dot: bool) -> tuple[int, int]:
    """(tokens per K/V tile, tiles in flight) for `programs` (sequence, KV head) pairs in
    `num_splits` splits, fitted on the H200 (benchmarks/RESULTS.md, "Two K/V tiles in
    flight", "Mid batches"). fp32 tiles are twice the bytes, halved; FP8 ones half, doubled.
    16-bit: two 64-key tiles in flight (8B step 64 x 4k 15.2 -> 12.7 ms), or at head dim 128
    three of 128 keys where one split is one or two programs a multiprocessor (8B
    verification 32 x 4k 11.1 -> 10.1 ms). FP8: 128-key tiles over five stages, the first depth
    at which Triton 3.6 keeps two K/V buffers, not one (83.2 -> 86.1% of an H100's copy at 64 x
    4k, 81.4 -> 85.0% at 256 x 1.5k, "FP8 KV decode: one tile in flight"). fp8_dot: tiles of at
    least 32 keys (`_check_cache`)."""
    if not q.is_cuda:
        return (_FP8_DOT_MIN_K if fp8_dot else 16), 3
    if k_cache.element_size() == 1:
        return 128, 5
    if q.element_size() > 2:
        return 32, 3
    sms = _num_sms(q.device)
    mid_batch = num_splits == 1 and sms <= programs < 2 * sms and q.shape[-1] >= _MID_BATCH_HEAD_DIM
    return (128, 3) if mid_batch else (64, 2)


def _split_launch(q: torch.Tensor, k_cache: torch.Tensor, out: torch.Tensor, workspace: torch.Tensor | None,
                  programs: int, num_splits: int, block_n: int | None, num_warps: int, num_stages: int | None,
                  read_ahead: bool, fp8_dot: bool) -> tuple[torch.Tensor, tuple[int, int, int], dict[str, Any]]:
    """What both launchers hand their split kernel besides their own inputs: the workspace's
    pointer and strides, and the tiling (defaults: `_default_tiling`), constexprs and launch
    options they share."""
    default_block_n, default_stages = _default_tiling(q, k_cache, programs, num_splits, fp8_dot)
    block_n, num_stages = block_n or default_block_n, num_stages or default_stages
    assert not fp8_dot or block_n >= _FP8_DOT_MIN_K, f"fp8_dot needs block_n >= 32, got {block_n}"
    ws, ws_strides = workspace_args(workspace, out)
    pdl = _pdl.pdl(q)
    launch = dict(QUERIES_PER_KV=q.shape[1] // k_cache.shape[2], HEAD_DIM=q.shape[2], PAGE_SIZE=k_cache.shape[1],
                  BLOCK_N=block_n, NUM_SPLITS=num_splits, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                  PDL=pdl, READ_AHEAD=read_ahead, FP8_DOT=fp8_dot, num_warps=num_warps, num_stages=num_stages,
                  launch_pdl=pdl)
    return ws, ws_strides, launch


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    read_ahead: bool = False,
    fp8_dot: bool = False,
) -> torch.Tensor:
    """Attention of one new query token per sequence over its paged K/V.

    Args:
        q: [batch, num_q_heads, head_dim], last dim contiguous; the token sits at position
            seq_lens[b] - 1 and its own K/V must already be in the cache.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous,
            q's dtype (fp16, bf16 or fp32) or float8_e4m3fn (`kernels.fp8`);
            num_q_heads % num_kv_heads == 0.
        block_tables: [batch, max_blocks_per_seq] int32.
        seq_lens: [batch] int32, context length including the new token (0 = padding row,
            output zeros).
        scale: softmax scale, usually head_dim ** -0.5.
        out: optional preallocated [batch, num_q_heads, head_dim] in q's dtype.
        workspace: optional float32 [>=batch, num_q_heads, num_splits, head_dim + 2] from
            `decode_workspace`; its shape[2] is the split count. Give it (or num_splits=1)
            to make the launch allocation-free and CUDA-graph-safe.
        num_splits: split count when no workspace is given; default `decode_num_splits`
            over the context block_tables can hold.
        block_n, num_warps, num_stages: tuning (tokens per K/V tile, warps, tiles in
            flight; the defaults: `_default_tiling`).
        read_ahead: the lengths, block tables and the KV before each sequence's new tokens
            were final before the kernel preceding this one started (the engine's step):
            read them, and the first K/V tile, before waiting for it (`kernels._pdl`).
        fp8_dot: an FP8 cache's tiles multiplied as e4m3, the query and P rounded to e4m3
            (the module's docstring): opt-in, it changes outputs (tests/kernels/
            test_paged_decode_fp8_dot.py states the error); needs an FP8 cache, head_dim and
            block_n >= 32.

    Returns:
        out.
    """
    batch, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    _check_cache(q, k_cache, v_cache, scale, fp8_dot)
    assert block_tables.dtype == torch.int32 and block_tables.shape[0] == batch
    assert seq_lens.dtype == torch.int32 and seq_lens.shape == (batch,)
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    if workspace is not None:
        num_splits = workspace.shape[2]
        assert workspace.dtype == torch.float32 and workspace.stride(-1) == 1
        assert workspace.shape[0] >= batch and workspace.shape[1:] == (num_q_heads, num_splits, head_dim + 2)
    elif num_splits is None:
        num_splits = decode_num_splits(batch, num_kv_heads, head_dim, block_tables.shape[1] * page_size, q.device)
    if num_splits > 1 and workspace is None:
        workspace = decode_workspace(batch, num_q_heads, head_dim, num_splits, q.device)
    if batch == 0:
        return out
    queries_per_kv = num_q_heads // num_kv_heads
    ws, ws_strides, launch = _split_launch(q, k_cache, out, workspace, batch * num_kv_heads, num_splits, block_n,
                                           num_warps, num_stages, read_ahead, fp8_dot)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, ws, scale * LOG2E,
        q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1), *ws_strides,
        num_kv_heads * head_dim,
        # tl.dot needs at least 16 rows: pad the query group.
        BLOCK_G=max(16, triton.next_power_of_2(queries_per_kv)), **launch,
    )
    if num_splits > 1:
        merge_splits(workspace, out, batch, ws_strides)
    return out


# Rows (new tokens x query heads of a KV group) one paged_verify program holds: 64 keeps
# its [rows, head_dim] fp32 accumulator at 64 registers a thread (4 warps, head dim 128).
VERIFY_MAX_ROWS = 64


def paged_verify_fits(max_seqlen_q: int, queries_per_kv: int) -> bool:
    """Whether paged_verify takes chunks of up to max_seqlen_q new tokens (host ints)."""
    return 0 < max_seqlen_q * queries_per_kv <= VERIFY_MAX_ROWS


def paged_verify(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seqlen_q: int,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    read_ahead: bool = False,
    fp8_dot: bool = False,
) -> torch.Tensor:
    """Causal attention of a few new query tokens per sequence over its paged K/V: what a
    speculative verification step asks (K + 1 tokens after the context). kernels.flash_prefill's
    semantics without k_new/v_new, but decode's work split: every K/V tile is loaded once
    for all of a sequence's new tokens and the query heads of its KV group, split-K over
    the context.

    Args:
        q: [num_tokens, num_q_heads, head_dim], sequences packed back to back, every row
            some sequence's (num_tokens == cu_seqlens_q[-1]); last dim contiguous.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous,
            q's dtype (fp16, bf16 or fp32) or float8_e4m3fn; every position of each sequence there, its new
            tokens' too (rotary_cache_write runs first).
        cu_seqlens_q: [batch + 1] int32 offsets of each sequence's tokens in q.
        seq_lens: [batch] int32 keys per sequence, its new tokens included; token i of
            sequence b sits at position seq_lens[b] - q_len_b + i.
        block_tables: [batch, max_blocks_per_seq] int32.
        scale: softmax scale, usually head_dim ** -0.5; > 0.
        max_seqlen_q: host int >= every q_len; paged_verify_fits(max_seqlen_q, group).
        out: optional preallocated [num_tokens, num_q_heads, head_dim] in q's dtype.
        num_splits: default decode_num_splits over the context block_tables can hold.
        block_n, num_warps, num_stages: tuning, as paged_decode's.
        read_ahead, fp8_dot: as paged_decode's.

    Returns:
        out. Allocates its split-K workspace (not for CUDA graphs).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    _check_cache(q, k_cache, v_cache, scale, fp8_dot)
    assert cu_seqlens_q.dtype == seq_lens.dtype == block_tables.dtype == torch.int32
    batch = cu_seqlens_q.shape[0] - 1
    assert seq_lens.shape == (batch,) and block_tables.shape[0] == batch and block_tables.stride(1) == 1
    queries_per_kv = num_q_heads // num_kv_heads
    if not paged_verify_fits(max(max_seqlen_q, 1), queries_per_kv):
        raise ValueError(f"paged_verify holds at most {VERIFY_MAX_ROWS} rows of new tokens x query heads per KV "
                         f"head; got {max_seqlen_q} tokens x {queries_per_kv} heads")
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    if num_tokens == 0 or batch == 0 or max_seqlen_q == 0:
        return out
    if num_splits is None:
        num_splits = decode_num_splits(batch, num_kv_heads, head_dim, block_tables.shape[1] * page_size, q.device)
    workspace = decode_workspace(num_tokens, num_q_heads, head_dim, num_splits, q.device) if num_splits > 1 else None
    ws, ws_strides, launch = _split_launch(q, k_cache, out, workspace, batch * num_kv_heads, num_splits, block_n,
                                           num_warps, num_stages, read_ahead, fp8_dot)
    _verify_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, out, ws, scale * LOG2E,
        q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1), *ws_strides,
        num_kv_heads * head_dim, BLOCK_R=max(16, triton.next_power_of_2(max_seqlen_q * queries_per_kv)), **launch,
    )
    if num_splits > 1:
        merge_splits(workspace, out, num_tokens, ws_strides)
    return out
