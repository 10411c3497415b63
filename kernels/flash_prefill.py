"""FlashAttention prefill over the paged KV cache: packed variable-length queries, causal.

Each program owns BLOCK_M queries of one (sequence, query head) and streams that
sequence's keys and values with an online softmax (running max m and sum l, the
accumulator rescaled as each tile arrives), so no score matrix reaches memory.

Where the new tokens' K/V come from decides the speed. Given `k_new`/`v_new` (the
step's own K/V, packed like q), the kernel reads earlier context (chunked prefill,
prefix-cache hits) through the block table and the new tokens from those contiguous
rows through tensor descriptors (Hopper's bulk tensor copies, TMA): a fresh prompt
never touches the paged gather, whose per-row address math costs registers the
softmax needs (+18% at 8k on an H200). Without them, every position is gathered from
the cache.

Tiles wholly left of the diagonal run without masks; only the tiles that straddle it
(or the end of the context) are masked; tiles wholly right of it are never visited.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from pdserve.kernels import fp8

LOG2E = 1.4426950408889634


@triton.jit
def _softmax_update(acc, l_i, m_i, s, v, scale_log2, DOT_PRECISION: tl.constexpr):
    """Fold one tile of raw scores s [BLOCK_M, BLOCK_N] and its values v into the state."""
    # Scale inside the exponent: one FMA per score instead of a separate multiply.
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s * scale_log2 - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # Accumulate in place (the dot's accumulator operand): no second [M, D] fp32 tile.
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _attend_paged(
    acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row, kv_col, q_pos,
    lo, hi, seq_len, scale_log2,
    row_stride, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Key positions [lo, hi) gathered from the cache through the block table; MASKED
    adds the causal mask and the length mask (positions >= seq_len)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + offs_n
        if MASKED:
            in_seq = pos < seq_len
            block_ids = tl.load(bt_row + pos // PAGE_SIZE, mask=in_seq, other=0).to(tl.int64)
        else:
            block_ids = tl.load(bt_row + pos // PAGE_SIZE).to(tl.int64)
        rows = (block_ids * PAGE_SIZE + pos % PAGE_SIZE) * row_stride + kv_col
        kv_offs = rows[:, None] + offs_d[None, :]                          # [BLOCK_N, D]
        if MASKED:
            k = tl.load(k_cache_ptr + kv_offs, mask=in_seq[:, None], other=0.0)
            v = tl.load(v_cache_ptr + kv_offs, mask=in_seq[:, None], other=0.0)
        else:
            k = tl.load(k_cache_ptr + kv_offs)
            v = tl.load(v_cache_ptr + kv_offs)
        k, v = k.to(q.dtype), v.to(q.dtype)  # an FP8 cache's tile, widened
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)            # [BLOCK_M, BLOCK_N]
        if MASKED:
            visible = (pos[None, :] <= q_pos[:, None]) & in_seq[None, :]
            s = tl.where(visible, s, float("-inf"))
        acc, l_i, m_i = _softmax_update(acc, l_i, m_i, s, v, scale_log2, DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _attend_new(
    acc, l_i, m_i, q, k_desc, v_desc, row0, kv_col, offs_m,
    lo, hi, scale_log2,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """The sequence's own new keys [lo, hi) (indices into its q_len new tokens), read as
    contiguous rows row0 + lo.. of k_new/v_new by TMA. MASKED adds the causal mask
    (key index <= query index); rows past the sequence's end then never count for a
    real query, whatever they hold (the next sequence's tokens, or TMA's zero fill)."""
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(lo, hi, BLOCK_N):
        k = k_desc.load([row0 + n0, kv_col])                                 # [BLOCK_N, D]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASKED:
            s = tl.where((n0 + offs_n)[None, :] <= offs_m[:, None], s, float("-inf"))
        v = v_desc.load([row0 + n0, kv_col])
        acc, l_i, m_i = _softmax_update(acc, l_i, m_i, s, v, scale_log2, DOT_PRECISION)
    return acc, l_i, m_i


# Values that change from batch to batch are not specialized on (Triton would compile a
# variant per "== 1" / "divisible by 16" class, seconds each, in the middle of serving).
@triton.jit(do_not_specialize=["stride_bt", "num_m_blocks"])
def _prefill_kernel(
    q_ptr,              # [num_tokens, num_q_heads, head_dim]
    k_cache_ptr,        # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,        # same as k_cache
    k_new_desc,         # None, or TMA descriptor over k_new as [num_tokens, num_kv_heads * head_dim]
    v_new_desc,         # same over v_new
    cu_seqlens_q_ptr,   # [batch + 1] int32
    seq_lens_ptr,       # [batch] int32, context including the new tokens
    block_tables_ptr,   # [batch, max_blocks_per_seq] int32
    out_ptr,            # [num_tokens, num_q_heads, head_dim]
    scale_log2,         # softmax scale * log2(e): the kernel works in base 2
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    num_m_blocks,       # grid size along axis 1
    # Head counts are run-time values: one compiled kernel serves every GQA ratio.
    num_q_heads, queries_per_kv, num_kv_heads,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    NEW_KV: tl.constexpr,
):
    # Axis 0 runs fastest: the query heads of one sequence sit side by side (heads of a
    # KV group share K/V tiles in L2), and axis 1 walks query tiles last-first so the
    # longest causal rows start in the first wave instead of straggling at the end.
    head = tl.program_id(0) % num_q_heads
    seq = tl.program_id(0) // num_q_heads
    m_block = num_m_blocks - 1 - tl.program_id(1)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_m = offs_m < q_len
    tokens = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=mask_m[:, None], other=0.0)                            # [BLOCK_M, D]
    q_pos = context_len + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_head = head // queries_per_kv
    kv_col = kv_head * HEAD_DIM
    row_stride = num_kv_heads * HEAD_DIM
    if NEW_KV:
        # Earlier context, all of it visible to every query: only the last, partial tile
        # needs a (length) mask.
        ctx_full = (context_len // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _attend_paged(
            acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row, kv_col, q_pos, 0, ctx_full, context_len,
            scale_log2, row_stride, HEAD_DIM, PAGE_SIZE, BLOCK_N, False, DOT_PRECISION)
        acc, l_i, m_i = _attend_paged(
            acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row, kv_col, q_pos, ctx_full, context_len,
            context_len, scale_log2, row_stride, HEAD_DIM, PAGE_SIZE, BLOCK_N, True, DOT_PRECISION)
        # The new tokens, indexed 0..q_len-1 like the queries.
        diag_lo = (m_block * BLOCK_M // BLOCK_N) * BLOCK_N
        diag_hi = tl.minimum(m_block * BLOCK_M + BLOCK_M, q_len)
        acc, l_i, m_i = _attend_new(
            acc, l_i, m_i, q, k_new_desc, v_new_desc, q_start, kv_col, offs_m, 0, diag_lo,
            scale_log2, BLOCK_N, False, DOT_PRECISION)
        acc, l_i, m_i = _attend_new(
            acc, l_i, m_i, q, k_new_desc, v_new_desc, q_start, kv_col, offs_m, diag_lo, diag_hi,
            scale_log2, BLOCK_N, True, DOT_PRECISION)
    else:
        # Keys before the tile's first query position are visible to every row of the tile.
        first_q_pos = context_len + m_block * BLOCK_M
        diag_lo = (first_q_pos // BLOCK_N) * BLOCK_N
        diag_hi = tl.minimum(first_q_pos + BLOCK_M, seq_len)
        acc, l_i, m_i = _attend_paged(
            acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row, kv_col, q_pos, 0, diag_lo, seq_len,
            scale_log2, row_stride, HEAD_DIM, PAGE_SIZE, BLOCK_N, False, DOT_PRECISION)
        acc, l_i, m_i = _attend_paged(
            acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row, kv_col, q_pos, diag_lo, diag_hi, seq_len,
            scale_log2, row_stride, HEAD_DIM, PAGE_SIZE, BLOCK_N, True, DOT_PRECISION)

    o = acc / l_i[:, None]
    tl.store(out_ptr + tokens[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mask_m[:, None])


def _default_tuning(dtype: torch.dtype, max_seqlen_q: int, is_cuda: bool, new_kv: bool,
                    head_dim: int = 128) -> dict[str, int]:
    """Tile shape and pipeline depth, from the H200 sweeps in benchmarks/RESULTS.md (head dim
    128). CPU (interpreter) gets the smallest legal tiles; fp32 smaller ones so that its
    double-size tiles still fit shared memory; so do 16-bit rows of head dim 256, where the
    sweep's tiles ask a Hopper program for up to 459,776 bytes of its 232,448 (Triton's count
    for sm_90, tests/kernels/test_shared_memory.py; these: 131-164 KB)."""
    if not is_cuda:
        return {"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 1}
    if dtype == torch.float32:
        return {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2}
    if head_dim * dtype.itemsize > 256:
        return {"block_m": 128, "block_n": 32, "num_warps": 4, "num_stages": 3}
    if new_kv and max_seqlen_q >= 4096:
        # Two warpgroups on 128 rows, TMA-fed 128-wide K/V tiles three deep (224 KB of
        # shared memory): best at 4k-8k in both v4 sweeps, within 2% at 16k.
        return {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3}
    if new_kv:
        # One warpgroup on 64 rows, 112 KB of shared memory: two programs share an SM and
        # hide each other's softmax behind their matrix products. 128-row tiles fall below
        # SDPA flash at 1k (the masked diagonal is a larger share there).
        return {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3}
    if max_seqlen_q >= 8192:
        # Two warpgroups on 256 rows share each K/V tile: +4% over 128 rows at 8k-16k.
        return {"block_m": 256, "block_n": 64, "num_warps": 8, "num_stages": 3}
    # Shorter sequences spend more of a tall tile on the masked diagonal; narrow K/V tiles
    # with a deeper pipeline did best at 1k-4k.
    return {"block_m": 128, "block_n": 32, "num_warps": 4, "num_stages": 4}


def _row_descriptor(x: torch.Tensor, block_n: int) -> TensorDescriptor:
    """TMA descriptor over [num_tokens, num_kv_heads, head_dim] seen as 2-D rows of
    num_kv_heads * head_dim, loading [block_n, head_dim] tiles (one KV head's slice)."""
    num_tokens, num_heads, head_dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != head_dim or x.data_ptr() % 16 or (x.stride(0) * x.element_size()) % 16:
        x = x.contiguous()  # TMA needs 16-byte-aligned rows; a fused qkv view normally has them
    return TensorDescriptor(x, [num_tokens, num_heads * head_dim], [x.stride(0), 1], [block_n, head_dim])


def flash_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seqlen_q: int,
    out: torch.Tensor | None = None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    **tuning: int,
) -> torch.Tensor:
    """Causal attention of packed new query tokens over their sequences' K/V.

    Args:
        q: [num_tokens, num_q_heads, head_dim], sequences packed back to back; last dim
            contiguous (a strided view of a fused qkv output is fine).
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous,
            q's dtype (fp16, bf16 or fp32) or float8_e4m3fn. K/V of earlier context (positions before each
            sequence's new tokens) must be there; without k_new/v_new the new tokens' too
            (rotary_cache_write runs first).
        cu_seqlens_q: [batch + 1] int32 query offsets into q.
        seq_lens: [batch] int32 context length per sequence including its new tokens;
            query i of sequence b sits at position seq_lens[b] - q_len_b + i.
        block_tables: [batch, max_blocks_per_seq] int32.
        scale: softmax scale, usually head_dim ** -0.5.
        max_seqlen_q: host int >= every q_len (sizes the grid; no host sync inside).
        out: optional preallocated [num_tokens, num_q_heads, head_dim] in q's dtype.
        k_new, v_new: optional [num_tokens, num_kv_heads, head_dim], the new tokens' K/V
            packed like q (views of a fused qkv output are fine; rows not 16-byte
            aligned are copied). Given, the new tokens are read from these through
            tensor descriptors (TMA on Hopper) and only earlier context from the cache;
            the cache may then hold the new tokens or not. Both or neither.
        tuning: block_m, block_n (powers of two >= 16), num_warps, num_stages,
            maxnreg (registers per thread, 0 = no cap).

    Returns:
        out.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    batch = seq_lens.shape[0]
    assert k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim, (k_cache.shape, q.shape)
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32) and k_cache.dtype == v_cache.dtype
    fp8.check_cache_dtype(q.dtype, k_cache.dtype)
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(-1) == 1
    assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
    assert scale > 0, "the kernel folds the scale into a running max"
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, f"head_dim must be a power of two >= 16, got {head_dim}"
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q.shape == (batch + 1,)
    assert seq_lens.dtype == torch.int32 and block_tables.dtype == torch.int32 and block_tables.shape[0] == batch
    new_kv = k_new is not None
    assert new_kv == (v_new is not None), "pass both k_new and v_new, or neither"
    if new_kv:
        assert k_new.shape == v_new.shape == (num_tokens, num_kv_heads, head_dim), (k_new.shape, v_new.shape)
        assert k_new.dtype == v_new.dtype == q.dtype
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    config = _default_tuning(q.dtype, max_seqlen_q, q.is_cuda, new_kv, head_dim) | tuning
    if num_tokens == 0 or max_seqlen_q == 0:
        return out
    k_desc = _row_descriptor(k_new, config["block_n"]) if new_kv else None
    v_desc = _row_descriptor(v_new, config["block_n"]) if new_kv else None
    num_m_blocks = triton.cdiv(max_seqlen_q, config["block_m"])
    _prefill_kernel[(batch * num_q_heads, num_m_blocks)](
        q, k_cache, v_cache, k_desc, v_desc, cu_seqlens_q, seq_lens, block_tables, out, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), num_m_blocks,
        num_q_heads, num_q_heads // num_kv_heads, num_kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_M=config["block_m"], BLOCK_N=config["block_n"],
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        NEW_KV=new_kv, num_warps=config["num_warps"], num_stages=config["num_stages"],
        # A register cap lets two 8-warp programs share an SM (ptxas spills past it).
        **({"maxnreg": config["maxnreg"]} if config.get("maxnreg") else {}),
    )
    return out
