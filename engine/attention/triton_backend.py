"""Attention on CUDA through the Triton kernels in `kernels/`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pdserve.engine.attention.base import AttentionMetadata
from pdserve.engine.kv.pool import KVPool
from pdserve.engine.models.rope import Rope
from pdserve.kernels.flash_prefill import flash_prefill
from pdserve.kernels.flash_prefill_ws import flash_prefill_ws, flash_prefill_ws_paged, flash_prefill_ws_supported
from pdserve.kernels.paged_decode import paged_decode, paged_verify, paged_verify_fits
from pdserve.kernels.rotary import rotary_cache_write

if TYPE_CHECKING:
    from pdserve.engine.models.layers import HeadNorm

# A step with earlier context runs on the Hopper kernel's paged entry point once its
# longest chunk fills a query tile (128 rows; the kernel runs one program per SM). Below
# that flash_prefill measured 1-65% faster at 5-64 new tokens over 4k of context (H200).
PAGED_PREFILL_MIN_QUERY_LEN = 128


class TritonAttention:
    """dtype: the model's (q, k, v); the pool's may be FP8. fp8_dot: decode and verification
    multiply an FP8 pool's tiles as e4m3 (`kernels.paged_decode`'s fp8_dot; prefill keeps
    widening them)."""

    def __init__(self, dtype: torch.dtype, fp8_dot: bool = False) -> None:
        self.dtype, self.fp8_dot = dtype, fp8_dot

    def begin_step(self, meta: AttentionMetadata, pool: KVPool, scale: float) -> _TritonStep:
        return _TritonStep(meta, pool, scale, self.dtype, self.fp8_dot)


class _TritonStep:
    def __init__(self, meta: AttentionMetadata, pool: KVPool, scale: float, dtype: torch.dtype,
                 fp8_dot: bool) -> None:
        self.meta, self.pool, self.scale, self.fp8_dot = meta, pool, scale, fp8_dot
        layout = pool.layout
        # On Hopper, the warp-specialized kernels: prompts with no earlier context (no chunk
        # before this one, no prefix hit) attend only to their own K/V, read as contiguous
        # tiles; other prefill steps gather theirs through the block table once some chunk
        # fills a 128-row query tile (from a cache of the model's dtype: that kernel reads no
        # FP8). Steps of only a few new tokens per sequence (speculative verification: K + 1)
        # take paged_verify, on any GPU; the rest flash_prefill (benchmarks/RESULTS.md, "v8"
        # and "verify").
        hopper = meta.num_prefills > 0 and flash_prefill_ws_supported(pool.kv.device, dtype, layout.head_dim,
                                                                      layout.block_size)
        self.fresh_prefills = hopper and meta.prefill_q_lens_host == meta.prefill_seq_lens_host
        self.paged_prefills = (hopper and not self.fresh_prefills and layout.dtype == dtype
                               and meta.prefill_max_seqlen_q >= PAGED_PREFILL_MIN_QUERY_LEN)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 rope: Rope, head_norm: HeadNorm | None = None) -> torch.Tensor:
        meta = self.meta
        k_cache, v_cache = self.pool.layer(layer_idx)
        # q's and k's heads normalized (a family that does) and rotated in place, k and v written
        # to the cache: one kernel. read_ahead: a step's inputs are uploaded before its first
        # kernel, and earlier KV is final.
        rotary_cache_write(q, k, v, rope.positions, rope.cos, rope.sin, k_cache, v_cache, meta.slot_mapping,
                           read_ahead=True, head_norms=None if head_norm is None else head_norm.kernel_args())
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            paged_decode(q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens,
                         self.scale, out=out[:nd], read_ahead=True, fp8_dot=self.fp8_dot)
        if self.fresh_prefills:
            flash_prefill_ws(q[nd:], k[nd:], v[nd:], meta.prefill_cu_seqlens_q, meta.prefill_max_seqlen_q, self.scale,
                             out=out[nd:])
        elif meta.num_prefills:
            args = (q[nd:], k_cache, v_cache, meta.prefill_cu_seqlens_q, meta.prefill_seq_lens,
                    meta.prefill_block_tables, self.scale, meta.prefill_max_seqlen_q)
            if paged_verify_fits(meta.prefill_max_seqlen_q, q.shape[1] // k_cache.shape[2]):
                # A few new tokens per sequence (speculative verification: K + 1): decode's
                # work split, every K/V tile read once for all its tokens and query heads.
                paged_verify(*args, out=out[nd:], read_ahead=True, fp8_dot=self.fp8_dot)
            elif self.paged_prefills:
                flash_prefill_ws_paged(*args, out=out[nd:])
            else:
                # The chunk's own K/V straight from the projection (contiguous rows, TMA);
                # only earlier context is gathered from the cache.
                flash_prefill(*args, out=out[nd:], k_new=k[nd:], v_new=v[nd:])
        return out
