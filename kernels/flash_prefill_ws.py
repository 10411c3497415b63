"""Warp-specialized causal prefill for Hopper (sm_90): packed variable-length sequences
attending only to their own tokens (fresh prompts: no earlier context in the paged
cache), GQA, head dim 128, bf16/fp16. FlashAttention-3's structure, written in Gluon
(kernels/_gluon_prefill_ws.py): a TMA producer warp and two consumer warpgroups taking
turns on the tensor cores. The engine uses it for steps whose prefills have no context
and kernels/flash_prefill.py's Triton kernel otherwise; ~25% faster than that kernel at
4k-16k on an H200 (benchmarks/RESULTS.md).

Gluon is experimental: where this Triton has no Gluon API the kernel was written for,
`flash_prefill_ws_supported` says no and the engine keeps the Triton kernel.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

HEAD_DIM = 128

try:
    from kernels import _gluon_prefill_ws as _gluon
except (ImportError, AttributeError, TypeError) as e:  # another Triton's Gluon: keep the Triton kernel
    logger.info("Gluon prefill kernel unavailable with this Triton (%s): using the Triton kernel", e)
    _gluon = None  # type: ignore[assignment]

_DTYPES = (torch.bfloat16, torch.float16)


def flash_prefill_ws_supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether flash_prefill_ws runs for this device, dtype and head dim: a Hopper GPU
    (its wgmma and TMA), bf16 or fp16, head dim 128, and a Triton with the Gluon API."""
    return (_gluon is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
            and dtype in _DTYPES and head_dim == HEAD_DIM)


def flash_prefill_ws(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
    out: torch.Tensor | None = None,
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

    Returns:
        out.

    Raises:
        ValueError: not supported here (see flash_prefill_ws_supported).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if not flash_prefill_ws_supported(q.device, q.dtype, head_dim):
        raise ValueError(f"flash_prefill_ws needs a Hopper GPU, bf16/fp16, head dim {HEAD_DIM} and Triton's Gluon; "
                         f"got {q.device}, {q.dtype}, head dim {head_dim}")
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim), (q.shape, k.shape, v.shape)
    assert q.dtype == k.dtype == v.dtype, (q.dtype, k.dtype, v.dtype)
    assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
    assert scale > 0, "the kernel folds the scale into a running max"
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.dim() == 1
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype, (out.shape, out.dtype)
    assert out.stride(2) == 1 and out.stride(1) == head_dim, out.stride()
    if num_tokens == 0 or max_seqlen == 0:
        return out
    _gluon.launch(q, k, v, cu_seqlens, max_seqlen, scale, out)
    return out
