"""FlashAttention prefill over the paged KV cache: packed variable-length queries, causal.

Each program owns BLOCK_M queries of one (sequence, query head) and streams that
sequence's K/V through its block table with an online softmax (running max m and
sum l, the accumulator rescaled as each tile arrives), so no score matrix reaches
memory. Earlier context (chunked prefill, prefix-cache hits) and the new tokens are
all read from the cache. Tiles wholly left of the diagonal run without masks; only
the few tiles that straddle it are masked; tiles wholly right of it are never visited.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _attend_tiles(
    acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row, kv_col, q_pos,
    lo, hi, seq_len, scale_log2,
    row_stride, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Online-softmax over key positions [lo, hi) of one sequence; MASKED adds the causal
    and length masks (needed only on tiles that cross the diagonal or the end)."""
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
        else:
            k = tl.load(k_cache_ptr + kv_offs)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)            # [BLOCK_M, BLOCK_N]
        if MASKED:
            visible = (pos[None, :] <= q_pos[:, None]) & in_seq[None, :]
            s = tl.where(visible, s, float("-inf"))
        # Scale inside the exponent (one FMA per score) rather than a separate multiply:
        # the softmax, not the matrix units, bounds this loop.
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s * scale_log2 - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_cache_ptr + kv_offs, mask=in_seq[:, None], other=0.0)
        else:
            v = tl.load(v_cache_ptr + kv_offs)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _prefill_kernel(
    q_ptr,              # [num_tokens, num_q_heads, head_dim]
    k_cache_ptr,        # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,        # same as k_cache
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
    kv_col = (head // queries_per_kv) * HEAD_DIM
    # Keys before the tile's first query position are visible to every row of the tile.
    first_q_pos = context_len + m_block * BLOCK_M
    diag_lo = (first_q_pos // BLOCK_N) * BLOCK_N
    diag_hi = tl.minimum(first_q_pos + BLOCK_M, seq_len)
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row, kv_col, q_pos, 0, diag_lo, seq_len,
        scale_log2, num_kv_heads * HEAD_DIM, HEAD_DIM, PAGE_SIZE, BLOCK_N, False, DOT_PRECISION)
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row, kv_col, q_pos, diag_lo, diag_hi, seq_len,
        scale_log2, num_kv_heads * HEAD_DIM, HEAD_DIM, PAGE_SIZE, BLOCK_N, True, DOT_PRECISION)

    o = acc / l_i[:, None]
    tl.store(out_ptr + tokens[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mask_m[:, None])


def _default_tuning(dtype: torch.dtype, max_seqlen_q: int, is_cuda: bool) -> dict[str, int]:
    """Tile shape and pipeline depth, from the H200 sweeps in benchmarks/RESULTS.md. CPU
    (interpreter) gets the smallest legal tiles; fp32 smaller ones so that its double-size
    tiles still fit shared memory."""
    if not is_cuda:
        return {"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 1}
    if dtype == torch.float32:
        return {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2}
    if max_seqlen_q >= 8192:
        # Two warpgroups on 256 rows share each K/V tile: +4% over 128 rows at 8k-16k.
        return {"block_m": 256, "block_n": 64, "num_warps": 8, "num_stages": 3}
    # Shorter sequences spend more of a tall tile on the masked diagonal; narrow K/V tiles
    # with a deeper pipeline did best at 1k-4k.
    return {"block_m": 128, "block_n": 32, "num_warps": 4, "num_stages": 4}


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
    **tuning: int,
) -> torch.Tensor:
    """Causal attention of packed new query tokens over their sequences' paged K/V.

    Args:
        q: [num_tokens, num_q_heads, head_dim], sequences packed back to back; last dim
            contiguous (a strided view of a fused qkv output is fine).
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous,
            q's dtype (fp16, bf16 or fp32). K/V of every position, earlier context and the
            new tokens alike, must already be in the cache (cache_write runs first).
        cu_seqlens_q: [batch + 1] int32 query offsets into q.
        seq_lens: [batch] int32 context length per sequence including its new tokens;
            query i of sequence b sits at position seq_lens[b] - q_len_b + i.
        block_tables: [batch, max_blocks_per_seq] int32.
        scale: softmax scale, usually head_dim ** -0.5.
        max_seqlen_q: host int >= every q_len (sizes the grid; no host sync inside).
        out: optional preallocated [num_tokens, num_q_heads, head_dim] in q's dtype.
        tuning: block_m, block_n (powers of two >= 16), num_warps, num_stages.

    Returns:
        out.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    batch = seq_lens.shape[0]
    assert k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim, (k_cache.shape, q.shape)
    assert q.dtype == k_cache.dtype == v_cache.dtype and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(-1) == 1
    assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
    assert scale > 0, "the kernel folds the scale into a running max"
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, f"head_dim must be a power of two >= 16, got {head_dim}"
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q.shape == (batch + 1,)
    assert seq_lens.dtype == torch.int32 and block_tables.dtype == torch.int32 and block_tables.shape[0] == batch
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    config = _default_tuning(q.dtype, max_seqlen_q, q.is_cuda) | tuning
    if num_tokens == 0 or max_seqlen_q == 0:
        return out
    num_m_blocks = triton.cdiv(max_seqlen_q, config["block_m"])
    _prefill_kernel[(batch * num_q_heads, num_m_blocks)](
        q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, out, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), num_m_blocks,
        num_q_heads, num_q_heads // num_kv_heads, num_kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_M=config["block_m"], BLOCK_N=config["block_n"],
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )
    return out
