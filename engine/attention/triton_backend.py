"""Attention on CUDA through the Triton kernels in `kernels/`."""

from __future__ import annotations

import torch

from engine.attention.base import AttentionMetadata
from engine.kv_pool import KVPool
from kernels.cache_write import cache_write
from kernels.flash_prefill import flash_prefill
from kernels.flash_prefill_ws import flash_prefill_ws, flash_prefill_ws_paged, flash_prefill_ws_supported
from kernels.paged_decode import paged_decode

# A step with earlier context runs on the Hopper kernel's paged entry point once its
# longest chunk fills a query tile (128 rows; the kernel runs one program per SM). Below
# that the Triton kernel measured 1-65% faster at 5-64 new tokens over 4k of context (H200).
PAGED_PREFILL_MIN_QUERY_LEN = 128


class TritonAttention:
    def begin_step(self, meta: AttentionMetadata, pool: KVPool, scale: float) -> _TritonStep:
        return _TritonStep(meta, pool, scale)


class _TritonStep:
    def __init__(self, meta: AttentionMetadata, pool: KVPool, scale: float) -> None:
        self.meta, self.pool, self.scale = meta, pool, scale
        layout = pool.layout
        # On Hopper, the warp-specialized kernels: prompts with no earlier context (no chunk
        # before this one, no prefix hit) attend only to their own K/V, read as contiguous
        # tiles; other prefill steps gather theirs through the block table once some chunk
        # fills a 128-row query tile. Steps of short chunks after context (speculative
        # verification: K + 1 tokens) keep the Triton kernel, whose smaller tiles and
        # several programs per SM suit them (benchmarks/RESULTS.md, "v8"). Elsewhere the
        # Triton kernel.
        hopper = meta.num_prefills > 0 and flash_prefill_ws_supported(pool.kv.device, layout.dtype, layout.head_dim,
                                                                      layout.block_size)
        self.fresh_prefills = hopper and meta.prefill_q_lens_host == meta.prefill_seq_lens_host
        self.paged_prefills = (hopper and not self.fresh_prefills
                               and meta.prefill_max_seqlen_q >= PAGED_PREFILL_MIN_QUERY_LEN)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        k_cache, v_cache = self.pool.layer(layer_idx)
        cache_write(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            paged_decode(q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens,
                         self.scale, out=out[:nd])
        if self.fresh_prefills:
            flash_prefill_ws(q[nd:], k[nd:], v[nd:], meta.prefill_cu_seqlens_q, meta.prefill_max_seqlen_q, self.scale,
                             out=out[nd:])
        elif self.paged_prefills:
            flash_prefill_ws_paged(q[nd:], k_cache, v_cache, meta.prefill_cu_seqlens_q, meta.prefill_seq_lens,
                                   meta.prefill_block_tables, self.scale, meta.prefill_max_seqlen_q, out=out[nd:])
        elif meta.num_prefills:
            # The chunk's own K/V straight from the projection (contiguous rows, TMA);
            # only earlier context is gathered from the cache.
            flash_prefill(q[nd:], k_cache, v_cache, meta.prefill_cu_seqlens_q, meta.prefill_seq_lens,
                          meta.prefill_block_tables, self.scale, meta.prefill_max_seqlen_q, out=out[nd:],
                          k_new=k[nd:], v_new=v[nd:])
        return out
