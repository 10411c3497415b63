"""Warp-specialized causal prefill for Hopper (sm_90): FlashAttention-3's structure,
written in Gluon (kernels/_gluon_prefill_ws.py), persistent, with a TMA producer warp and
two consumer warpgroups taking turns on the tensor cores. Packed variable-length
sequences, GQA, head dim 128, bf16/fp16. Two entry points over one kernel body:

- flash_prefill_ws: prompts with no earlier context, their K/V straight from the
  projection (contiguous TMA tiles), ~1.3x kernels/flash_prefill.py's Triton kernel at
  4k-16k on an H200 (1.5x at 1k);
- flash_prefill_ws_paged: flash_prefill's semantics (new tokens after context already in
  the paged cache: chunked prefill, prefix-cache hits), each K/V tile gathered block by
  block through the block table; ~1.4x that Triton kernel at 2 x (4k context + 4k new),
  slower than it for chunks well under one 128-row query tile.

The engine uses the first for steps whose prefills are all fresh, the second for other
steps with a chunk of >= 128 tokens, and the Triton kernel for the rest
(benchmarks/RESULTS.md).

Gluon is experimental: where this Triton has no Gluon API the kernel was written for,
`flash_prefill_ws_supported` says no and the engine keeps the Triton kernel.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

HEAD_DIM = 128

try:
    from pdserve.kernels import _gluon_prefill_ws as _gluon
except (ImportError, AttributeError, TypeError) as e:  # another Triton's Gluon: keep the Triton kernel
    logger.info("Gluon prefill kernel unavailable with this Triton (%s): using the Triton kernel", e)
    _gluon = None  # type: ignore[assignment]

_DTYPES = (torch.bfloat16, torch.float16)


def flash_prefill_ws_supported(device: torch.device, dtype: torch.dtype, head_dim: int,
                               block_size: int | None = None) -> bool:
    """Whether flash_prefill_ws runs for this device, dtype and head dim: a Hopper GPU
    (its wgmma and TMA), bf16 or fp16, head dim 128, and a Triton with the Gluon API. With
    block_size, whether flash_prefill_ws_paged runs over a cache of that block size too
    (16, 32, 64 or 128 tokens: a 128-key tile is whole blocks)."""
    return (_gluon is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
            and dtype in _DTYPES and head_dim == HEAD_DIM
            and (block_size is None or block_size in _gluon.BLOCK_SIZES))


def _refuse_unsupported(name: str, q: torch.Tensor, block_size: int | None = None) -> None:
    if not flash_prefill_ws_supported(q.device, q.dtype, q.shape[-1], block_size):
        needs, got = "", ""
        if block_size is not None:
            needs, got = ", block size 16/32/64/128", f", block size {block_size}"
        raise ValueError(f"{name} needs a Hopper GPU, bf16/fp16, head dim {HEAD_DIM}{needs} and Triton's Gluon; "
                         f"got {q.device}, {q.dtype}, head dim {q.shape[-1]}{got}")


def _check_out(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype, (out.shape, out.dtype)
    assert out.stride(2) == 1 and out.stride(1) == q.shape[-1], out.stride()
    return out


def flash_prefill_ws(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
    out: torch.Tensor | None = None,
    max_programs: int | None = None,
) -> torch.Tensor:
    """Causal attention of packed sequences over their own keys (no earlier context).

    Args:
        q: [num_tokens, num_q_heads, 128] bf16 or fp16, sequences packed back to back;
            last dim contiguous (a strided view of a fused qkv output is fine).
        k, v: [num_tokens, num_kv_heads, 128], q's dtype, packed like q; num_kv_heads
            divides num_q_heads (GQA).
        cu_seqlens: [batch + 1] int32 offsets of each sequence in q/k/v.
        max_seqlen: host int >= every sequence length (sizes the grid; no host sync).
        scale: softmax scale, usually 128 ** -0.5; > 0.
        out: optional preallocated [num_tokens, num_q_heads, 128] in q's dtype, last two
            dims contiguous.
        max_programs: cap on the persistent grid (default one program per SM; tests use
            a few to run many work items per program).

    Returns:
        out.

    Raises:
        ValueError: not supported here (see flash_prefill_ws_supported).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    _refuse_unsupported("flash_prefill_ws", q)
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim), (q.shape, k.shape, v.shape)
    assert q.dtype == k.dtype == v.dtype, (q.dtype, k.dtype, v.dtype)
    assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
    assert scale > 0, "the kernel folds the scale into a running max"
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.dim() == 1
    out = _check_out(q, out)
    if num_tokens == 0 or max_seqlen == 0:
        return out
    _gluon.launch(q, k, v, cu_seqlens, max_seqlen, scale, out, max_programs)
    return out


def flash_prefill_ws_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seqlen_q: int,
    out: torch.Tensor | None = None,
    max_programs: int | None = None,
) -> torch.Tensor:
    """Causal attention of packed new query tokens over their sequences' K/V in the paged
    cache: kernels.flash_prefill's semantics without k_new/v_new.

    Args:
        q: [num_tokens, num_q_heads, 128] bf16 or fp16, sequences packed back to back;
            last dim contiguous.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, 128], contiguous, q's
            dtype, block_size 16/32/64/128. Every position of each sequence must be there,
            its new tokens' too (rotary_cache_write runs first). Whole blocks are read, so the
            slots of a sequence's last block past its end must hold finite values (the
            engine's pool starts zeroed and only ever holds K/V): 0 x NaN would reach the
            output.
        cu_seqlens_q: [batch + 1] int32 query offsets into q.
        seq_lens: [batch] int32 keys per sequence, its new tokens included; query i of
            sequence b sits at position seq_lens[b] - q_len_b + i.
        block_tables: [batch, max_blocks_per_seq] int32, last dim contiguous; entries past
            a sequence's last block are never read.
        scale: softmax scale, usually 128 ** -0.5; > 0.
        max_seqlen_q: host int >= every q_len (sizes the grid; no host sync).
        out: optional preallocated [num_tokens, num_q_heads, 128] in q's dtype, last two
            dims contiguous.
        max_programs: cap on the persistent grid (default one program per SM).

    Returns:
        out.

    Raises:
        ValueError: not supported here (see flash_prefill_ws_supported).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
    _refuse_unsupported("flash_prefill_ws_paged", q, block_size)
    assert k_cache.shape == v_cache.shape == (num_blocks, block_size, num_kv_heads, head_dim), (k_cache.shape,
                                                                                               v_cache.shape)
    assert k_cache.dtype == v_cache.dtype == q.dtype, (q.dtype, k_cache.dtype, v_cache.dtype)
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
    assert scale > 0, "the kernel folds the scale into a running max"
    assert cu_seqlens_q.dtype == seq_lens.dtype == block_tables.dtype == torch.int32
    assert block_tables.dim() == 2 and block_tables.stride(1) == 1, block_tables.stride()
    out = _check_out(q, out)
    if num_tokens == 0 or max_seqlen_q == 0 or cu_seqlens_q.shape[0] == 1:
        return out
    _gluon.launch_paged(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, max_seqlen_q, out,
                        max_programs)
    return out
