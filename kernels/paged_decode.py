"""Paged-attention decode: one query token per sequence, split-K over the context.

Each program takes one (sequence, KV head, split): the query heads of that KV group
share every K/V tile it loads (GQA), and a long context is cut into `num_splits`
slices run by separate programs so that batch 1 still fills the GPU (flash-decoding).
With several splits, each writes its unnormalised partial output plus its running
max and sum into a float32 workspace and a second kernel merges them.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# A split shorter than this many tokens costs more in launch and merge than it gains.
_MIN_TOKENS_PER_SPLIT = 128
_MAX_SPLITS = 128
# Past this many tokens per split, fewer and longer splits did better (8 x 32k on the H200).
_LONG_SPLIT_TOKENS = 2048


# stride_bt (blocks per row of this batch's table) changes from step to step in eager
# mode: not specialized on, so that it never triggers a compile while serving.
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
    NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)

    # Equal whole tiles per split so that no split waits on a longer one.
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * QUERIES_PER_KV + offs_g
    mask_g = offs_g < QUERIES_PER_KV
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None], other=0.0)                          # [BLOCK_G, D]

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        valid = pos < end
        block_ids = tl.load(bt_row + pos // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
        rows = (block_ids * PAGE_SIZE + pos % PAGE_SIZE) * row_stride + kv_head * HEAD_DIM
        kv_offs = rows[:, None] + offs_d[None, :]                          # [BLOCK_N, D]
        k = tl.load(k_cache_ptr + kv_offs, mask=valid[:, None], other=0.0)
        v = tl.load(v_cache_ptr + kv_offs, mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        s = tl.where(valid[None, :], s, float("-inf"))                     # [BLOCK_G, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s * scale_log2 - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        # seq_len 0 (a padded CUDA-graph row) leaves l_i = 0: write zeros, not NaN.
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=mask_g[:, None])
    else:
        ws = ws_ptr + seq.to(tl.int64) * stride_wb + heads * stride_wh + split * stride_ws
        tl.store(ws[:, None] + offs_d[None, :], acc, mask=mask_g[:, None])
        tl.store(ws + HEAD_DIM, m_i, mask=mask_g)
        tl.store(ws + HEAD_DIM + 1, l_i, mask=mask_g)


@triton.jit
def _decode_merge_kernel(
    ws_ptr,     # [>=batch, num_q_heads, num_splits, head_dim + 2] fp32: acc, max (base 2), sum
    out_ptr,    # [batch, num_q_heads, head_dim]
    stride_wb, stride_wh, stride_ws, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_s = offs_s < NUM_SPLITS
    ws = ws_ptr + seq.to(tl.int64) * stride_wb + head * stride_wh + offs_s * stride_ws
    m = tl.load(ws + HEAD_DIM, mask=mask_s, other=float("-inf"))
    l = tl.load(ws + HEAD_DIM + 1, mask=mask_s, other=0.0)
    acc = tl.load(ws[:, None] + offs_d[None, :], mask=mask_s[:, None], other=0.0)
    m_max = tl.max(m, 0)
    # Empty splits carry m = -inf; guard -inf - -inf when the whole row is empty.
    w = tl.where(m > float("-inf"), tl.math.exp2(m - tl.maximum(m_max, -1e30)), 0.0)
    l_sum = tl.sum(w * l, 0)
    o = tl.sum(w[:, None] * acc, 0) / tl.where(l_sum > 0, l_sum, 1.0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty))


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def decode_num_splits(batch: int, num_kv_heads: int, max_context_len: int, device: torch.device) -> int:
    """Split count the launcher picks when given none (host-only arithmetic, no sync).

    One split when the batch alone gives two programs per multiprocessor. Otherwise about
    four programs per multiprocessor, or two when that still leaves splits longer than
    _LONG_SPLIT_TOKENS; never splits shorter than _MIN_TOKENS_PER_SPLIT tokens. Fitted to
    the H200 sweeps in benchmarks/RESULTS.md.
    """
    num_sms = _num_sms(device)
    programs = batch * num_kv_heads
    if programs >= 2 * num_sms:
        return 1
    want = triton.cdiv(4 * num_sms, programs)
    if max_context_len // want > _LONG_SPLIT_TOKENS:
        want = triton.cdiv(2 * num_sms, programs)
    return max(1, min(want, max_context_len // _MIN_TOKENS_PER_SPLIT, _MAX_SPLITS))


def decode_workspace(
    batch: int, num_q_heads: int, head_dim: int, num_splits: int, device: torch.device | str
) -> torch.Tensor:
    """Preallocated split-K workspace for `paged_decode` (allocate once, outside CUDA graphs).

    Returns float32 [batch, num_q_heads, num_splits, head_dim + 2]; its shape[2] sets the
    split count of every launch that receives it. Size: 4 * batch * num_q_heads *
    num_splits * (head_dim + 2) bytes.
    """
    return torch.empty(batch, num_q_heads, num_splits, head_dim + 2, dtype=torch.float32, device=device)


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
    num_stages: int = 3,
) -> torch.Tensor:
    """Attention of one new query token per sequence over its paged K/V.

    Args:
        q: [batch, num_q_heads, head_dim], last dim contiguous; the token sits at position
            seq_lens[b] - 1 and its own K/V must already be in the cache.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous,
            q's dtype (fp16, bf16 or fp32); num_q_heads % num_kv_heads == 0.
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
        block_n, num_warps, num_stages: tuning (tokens per K/V tile: default 64, 32 for fp32,
            16 on CPU).

    Returns:
        out.
    """
    batch, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    assert k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim, (k_cache.shape, q.shape)
    assert q.dtype == k_cache.dtype == v_cache.dtype and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(-1) == 1
    assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
    assert scale > 0, "the kernel folds the scale into a running max"
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, f"head_dim must be a power of two >= 16, got {head_dim}"
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
        num_splits = decode_num_splits(batch, num_kv_heads, block_tables.shape[1] * page_size, q.device)
    if num_splits > 1 and workspace is None:
        workspace = decode_workspace(batch, num_q_heads, head_dim, num_splits, q.device)
    if batch == 0:
        return out
    if block_n is None:
        # fp32 tiles are twice the bytes: halve them to stay inside shared memory.
        block_n = (64 if q.element_size() <= 2 else 32) if q.is_cuda else 16
    queries_per_kv = num_q_heads // num_kv_heads
    ws = workspace if workspace is not None else out  # unused when num_splits == 1
    ws_strides = (ws.stride(0), ws.stride(1), ws.stride(2)) if workspace is not None else (0, 0, 0)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, ws, scale * LOG2E,
        q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1), *ws_strides,
        num_kv_heads * head_dim, QUERIES_PER_KV=queries_per_kv, HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        # tl.dot needs at least 16 rows: pad the query group.
        BLOCK_G=max(16, triton.next_power_of_2(queries_per_kv)), BLOCK_N=block_n,
        NUM_SPLITS=num_splits, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        _decode_merge_kernel[(batch, num_q_heads)](
            workspace, out, *ws_strides, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
            num_warps=4,
        )
    return out
