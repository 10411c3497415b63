"""Multi-head latent attention (MLA, DeepSeek-V2/V3) prefill over expanded, contiguous K/V:
packed variable-length queries, causal, with a query/key width different from the value
width.

The caller expands the latents of each sequence's keys (its cached prefix and the chunk's
own tokens, gathered from the latent cache) through W_UK and W_UV: per head, the key is
[k_nope (qk_nope_head_dim: 128 for V3), k_pe (rope_dim 64, one for all heads)] and the value
v_head_dim (128) wide. The score is q_nope . k_nope + q_pe . k_pe, two dots of power-of-two
widths (192 is none), and k_pe is read from its [tokens, rope_dim] rows, never broadcast
into a per-head copy.

FlashAttention's structure as in `flash_prefill`: each program owns BLOCK_M queries of one
(sequence, head) and streams that sequence's keys with an online softmax; tiles wholly left
of the diagonal run without masks, only the tiles that straddle it (or the end of the keys)
are masked, tiles wholly right of it are never visited.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _load_rows(ptrs, in_seq, MASKED: tl.constexpr):
    """A K or V tile; MASKED: rows past the sequence's keys read as zeros."""
    if MASKED:
        return tl.load(ptrs, mask=in_seq[:, None], other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _attend(
    acc, l_i, m_i, q_nope, q_pe, k_nope_ptr, k_pe_ptr, v_ptr, k_row0, head, q_pos, lo, hi, k_len, scale_log2,
    stride_knt, stride_knh, stride_kpt, stride_vt, stride_vh,
    NOPE_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Keys [lo, hi) of one sequence (rows k_row0 + lo .. of K/V) into the online softmax of
    the query tile (running max in base 2, sum, unnormalised output [BLOCK_M, V_DIM]). MASKED
    adds the causal mask (key <= q_pos) and the length mask (key < k_len)."""
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + offs_n
        rows = (k_row0 + pos).to(tl.int64)
        in_seq = pos < k_len
        k_nope = _load_rows(k_nope_ptr + rows[:, None] * stride_knt + head * stride_knh
                            + tl.arange(0, NOPE_DIM)[None, :], in_seq, MASKED)
        k_pe = _load_rows(k_pe_ptr + rows[:, None] * stride_kpt + tl.arange(0, ROPE_DIM)[None, :], in_seq, MASKED)
        s = tl.dot(q_nope, tl.trans(k_nope), input_precision=DOT_PRECISION)
        s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision=DOT_PRECISION)   # [BLOCK_M, BLOCK_N]
        if MASKED:
            s = tl.where((pos[None, :] <= q_pos[:, None]) & in_seq[None, :], s, float("-inf"))
        v = _load_rows(v_ptr + rows[:, None] * stride_vt + head * stride_vh + tl.arange(0, V_DIM)[None, :],
                       in_seq, MASKED)
        # Scale inside the exponent: one FMA per score instead of a separate multiply.
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s * scale_log2 - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


# Values that change from batch to batch are not specialized on (a compile per class of
# "== 1" / "divisible by 16" in the middle of serving).
@triton.jit(do_not_specialize=["num_m_blocks"])
def _mla_prefill_kernel(
    q_nope_ptr,         # [num_q_tokens, num_heads, nope_dim]
    q_pe_ptr,           # [num_q_tokens, num_heads, rope_dim]
    k_nope_ptr,         # [num_k_tokens, num_heads, nope_dim]
    k_pe_ptr,           # [num_k_tokens, rope_dim], shared by the heads
    v_ptr,              # [num_k_tokens, num_heads, v_dim]
    cu_seqlens_q_ptr,   # [batch + 1] int32
    cu_seqlens_k_ptr,   # [batch + 1] int32
    out_ptr,            # [num_q_tokens, num_heads, v_dim]
    scale_log2,         # softmax scale * log2(e): the kernel works in base 2
    stride_qnt, stride_qnh, stride_qpt, stride_qph, stride_knt, stride_knh, stride_kpt, stride_vt, stride_vh,
    stride_ot, stride_oh,
    num_heads, num_m_blocks,
    NOPE_DIM: tl.constexpr, ROPE_DIM: tl.constexpr, V_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Axis 0 runs fastest: a sequence's heads side by side (they share k_pe tiles in L2);
    # axis 1 walks query tiles last-first so the longest causal rows start in the first wave.
    head = tl.program_id(0) % num_heads
    seq = tl.program_id(0) // num_heads
    m_block = num_m_blocks - 1 - tl.program_id(1)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    k_start = tl.load(cu_seqlens_k_ptr + seq)
    k_len = tl.load(cu_seqlens_k_ptr + seq + 1) - k_start

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < q_len
    tokens = (q_start + offs_m).to(tl.int64)
    q_nope = tl.load(q_nope_ptr + tokens[:, None] * stride_qnt + head * stride_qnh + tl.arange(0, NOPE_DIM)[None, :],
                     mask=mask_m[:, None], other=0.0)                     # [BLOCK_M, NOPE_DIM]
    q_pe = tl.load(q_pe_ptr + tokens[:, None] * stride_qpt + head * stride_qph + tl.arange(0, ROPE_DIM)[None, :],
                   mask=mask_m[:, None], other=0.0)                       # [BLOCK_M, ROPE_DIM]
    q_pos = k_len - q_len + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, V_DIM], tl.float32)
    # Keys before the tile's first query position are visible to every row of the tile.
    first_q_pos = k_len - q_len + m_block * BLOCK_M
    diag_lo = (first_q_pos // BLOCK_N) * BLOCK_N
    diag_hi = tl.minimum(first_q_pos + BLOCK_M, k_len)
    acc, l_i, m_i = _attend(
        acc, l_i, m_i, q_nope, q_pe, k_nope_ptr, k_pe_ptr, v_ptr, k_start, head, q_pos, 0, diag_lo, k_len,
        scale_log2, stride_knt, stride_knh, stride_kpt, stride_vt, stride_vh,
        NOPE_DIM, ROPE_DIM, V_DIM, BLOCK_N, False, DOT_PRECISION)
    acc, l_i, m_i = _attend(
        acc, l_i, m_i, q_nope, q_pe, k_nope_ptr, k_pe_ptr, v_ptr, k_start, head, q_pos, diag_lo, diag_hi, k_len,
        scale_log2, stride_knt, stride_knh, stride_kpt, stride_vt, stride_vh,
        NOPE_DIM, ROPE_DIM, V_DIM, BLOCK_N, True, DOT_PRECISION)

    o = acc / l_i[:, None]
    tl.store(out_ptr + tokens[:, None] * stride_ot + head * stride_oh + tl.arange(0, V_DIM)[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mask_m[:, None])


def mla_prefill_tuning(dtype: torch.dtype, is_cuda: bool) -> dict[str, int]:
    """Default block_m, block_n, num_warps, num_stages. GPU 16-bit: two warpgroups on 128 rows,
    two 64-key tiles of K (192 wide) and V (128) in flight, ~112 KB of shared memory with the
    query; float32 smaller (twice the bytes). A prediction, not yet swept on a GPU. CPU
    (interpreter): the least tl.dot takes."""
    if not is_cuda:
        return {"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 1}
    if dtype == torch.float32:
        return {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2}
    return {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 2}


def mla_prefill(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
    max_seqlen_q: int,
    out: torch.Tensor | None = None,
    **tuning: int,
) -> torch.Tensor:
    """Causal attention of packed new query tokens over their sequences' expanded keys and
    values (the module's docstring), the value width independent of the key's.

    Args:
        q_nope: [num_q_tokens, num_heads, nope_dim], sequences packed back to back.
        q_pe: [num_q_tokens, num_heads, rope_dim], the rotated part.
        k_nope: [num_k_tokens, num_heads, nope_dim], each sequence's keys packed back to back
            (its cached prefix, then its new tokens).
        k_pe: [num_k_tokens, rope_dim] (or [num_k_tokens, 1, rope_dim]), the rotated key part
            every head shares.
        v: [num_k_tokens, num_heads, v_dim].
            All five in one dtype (fp16, bf16 or fp32), last dim contiguous (views of wider
            projection outputs are fine); nope_dim, rope_dim, v_dim powers of two >= 16.
        cu_seqlens_q, cu_seqlens_k: [batch + 1] int32 offsets of each sequence's queries and
            keys; query i of sequence b sits at key position k_len_b - q_len_b + i and sees
            keys up to it (k_len_b >= q_len_b).
        scale: softmax scale (DeepSeek: (nope_dim + rope_dim) ** -0.5, times YaRN's mscale
            squared).
        max_seqlen_q: host int >= every q_len (sizes the grid; no host sync inside).
        out: optional preallocated [num_q_tokens, num_heads, v_dim] in q's dtype.
        tuning: block_m, block_n (powers of two >= 16), num_warps, num_stages; defaults
            `mla_prefill_tuning`.

    Returns:
        out.
    """
    num_q_tokens, num_heads, nope_dim = q_nope.shape
    if k_pe.dim() == 3:
        assert k_pe.shape[1] == 1, f"k_pe is shared by the heads: [num_k_tokens, 1, rope_dim], got {k_pe.shape}"
        k_pe = k_pe[:, 0]
    num_k_tokens, rope_dim = k_pe.shape
    v_dim = v.shape[2]
    batch = cu_seqlens_q.shape[0] - 1
    assert q_pe.shape == (num_q_tokens, num_heads, rope_dim), (q_nope.shape, q_pe.shape)
    assert k_nope.shape == (num_k_tokens, num_heads, nope_dim), (k_nope.shape, q_nope.shape)
    assert v.shape[:2] == (num_k_tokens, num_heads), (v.shape, k_nope.shape)
    tensors = (q_nope, q_pe, k_nope, k_pe, v)
    assert q_nope.dtype in (torch.float16, torch.bfloat16, torch.float32)
    assert all(t.dtype == q_nope.dtype for t in tensors), [t.dtype for t in tensors]
    assert all(t.stride(-1) == 1 for t in tensors), "last dims must be contiguous"
    for name, dim in (("nope_dim", nope_dim), ("rope_dim", rope_dim), ("v_dim", v_dim)):
        assert dim >= 16 and dim & (dim - 1) == 0, f"{name} must be a power of two >= 16, got {dim}"
    assert scale > 0, "the kernel folds the scale into a running max"
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32 and cu_seqlens_k.shape == (batch + 1,)
    if out is None:
        out = q_nope.new_empty(num_q_tokens, num_heads, v_dim)
    assert out.shape == (num_q_tokens, num_heads, v_dim) and out.dtype == q_nope.dtype and out.stride(-1) == 1
    config = mla_prefill_tuning(q_nope.dtype, q_nope.is_cuda) | tuning
    if num_q_tokens == 0 or max_seqlen_q == 0 or batch == 0:
        return out
    num_m_blocks = triton.cdiv(max_seqlen_q, config["block_m"])
    _mla_prefill_kernel[(batch * num_heads, num_m_blocks)](
        q_nope, q_pe, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, out, scale * LOG2E,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), k_nope.stride(0), k_nope.stride(1),
        k_pe.stride(0), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        num_heads, num_m_blocks,
        NOPE_DIM=nope_dim, ROPE_DIM=rope_dim, V_DIM=v_dim, BLOCK_M=config["block_m"], BLOCK_N=config["block_n"],
        DOT_PRECISION="ieee" if q_nope.dtype == torch.float32 else "tf32",
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )
    return out
