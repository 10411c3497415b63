"""Multi-head latent attention on CUDA through `kernels.mla_decode` and `kernels.mla_prefill`.

The step's new latents ([c_kv | k_pe], k_pe rotated) are written into the layer's latent
cache first, and the queries' rope part rotated in place, in one launch (`kernels.mla_cache`:
a padded token's slot -1 writes nothing). Decodes, and
chunks of at most `MLA_VERIFY_MAX_Q` new tokens a sequence (speculative verification's
K + 1), then attend in the absorbed form over the cache (q_nope @ W_UK, the kernel's output
in the latent space, then W_UV): one latent read a sequence for all its heads and tokens,
and no host value of the step needed, so these steps replay as CUDA graphs
(`engine/runner/cuda_graphs.py`). Longer prefill chunks gather their sequences' whole latents
from the cache (the cached prefix and the chunk), expand them through kv_b_proj and attend
causally (`mla_prefill`, a value narrower than the key): eager steps, sized on the host.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pdserve.engine.attention.base import AttentionMetadata
from pdserve.engine.kv.pool import KVPool
from pdserve.engine.models.rope import Rope
from pdserve.kernels.mla_cache import write_latents
from pdserve.kernels.mla_decode import mla_decode
from pdserve.kernels.mla_prefill import mla_prefill

if TYPE_CHECKING:
    from pdserve.engine.models.layers import HeadNorm, MLAProjection

# New tokens a sequence up to which a chunk attends absorbed (mla_decode's verification
# form) rather than expanded: a program holds 64 rows (tokens x heads) on the GPU, so 8
# tokens leave it 8 heads. Expanding would run kv_b_proj over the whole context for them.
MLA_VERIFY_MAX_Q = 8


def mla_verify_fits(max_seqlen_q: int) -> bool:
    """Whether chunks of up to max_seqlen_q new tokens attend absorbed (host int)."""
    return 0 < max_seqlen_q <= MLA_VERIFY_MAX_Q


def _prefill_slots(meta: AttentionMetadata, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the cache slots of every prefill sequence's positions 0..seq_len-1, packed [sum], and
    their offsets cu_seqlens_k [num_prefills + 1] int32), built on the device."""
    device = meta.slot_mapping.device
    lens = torch.tensor(meta.prefill_seq_lens_host, dtype=torch.int64, device=device)
    cu = torch.zeros(len(meta.prefill_seq_lens_host) + 1, dtype=torch.int64, device=device)
    cu[1:] = lens.cumsum(0)
    seq = torch.repeat_interleave(torch.arange(lens.shape[0], device=device), lens)
    pos = torch.arange(int(sum(meta.prefill_seq_lens_host)), device=device) - cu[seq]
    blocks = meta.prefill_block_tables[seq, pos // block_size].long()
    return blocks * block_size + pos % block_size, cu.to(torch.int32)


class TritonMLAStep:
    def __init__(self, meta: AttentionMetadata, pool: KVPool, scale: float) -> None:
        self.meta, self.pool, self.scale = meta, pool, scale
        self.verify = meta.num_prefills > 0 and mla_verify_fits(meta.prefill_max_seqlen_q)
        expand = meta.num_prefills and not self.verify
        self.prefill = _prefill_slots(meta, pool.layout.block_size) if expand else None

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 rope: Rope, head_norm: HeadNorm | None = None) -> torch.Tensor:
        raise ValueError("a latent (mla) KV pool holds no per-head K and V: the model must call AttentionStep.mla")

    def mla(self, layer_idx: int, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, rope: Rope,
            projection: MLAProjection) -> torch.Tensor:
        meta, nope = self.meta, projection.qk_nope_head_dim
        q_pe = q[..., nope:]  # rotated in place, k_pe as it is written
        cache = self.pool.latent(layer_idx)  # [num_blocks, block_size, latent_dim]
        write_latents(cache, meta.slot_mapping, kv_c, k_pe, rope=(q_pe, rope.positions, rope.cos, rope.sin))
        out = q.new_empty(q.shape[0], q.shape[1], projection.v_head_dim)
        nd = meta.num_decodes
        if nd or self.verify:
            w_uk, w_uv = projection.absorbed(q.dtype)

            def absorbed(rows: slice, **tables: torch.Tensor | int) -> None:
                q_latent = torch.einsum("thn,hnr->thr", q[rows, :, :nope], w_uk)
                o_latent = mla_decode(q_latent, q_pe[rows], cache, scale=self.scale, **tables)
                out[rows] = torch.einsum("thr,hvr->thv", o_latent, w_uv)

            if nd:
                absorbed(slice(None, nd), block_tables=meta.decode_block_tables, seq_lens=meta.decode_seq_lens)
            if self.verify:
                absorbed(slice(nd, None), block_tables=meta.prefill_block_tables, seq_lens=meta.prefill_seq_lens,
                         cu_seqlens_q=meta.prefill_cu_seqlens_q, max_seqlen_q=meta.prefill_max_seqlen_q)
        if self.prefill is not None:
            slots, cu_k = self.prefill
            flat = cache.view(-1, cache.shape[-1])
            latents = flat[slots].to(q.dtype)
            rank = latents.shape[-1] - q_pe.shape[-1]
            k_nope, v = projection.expand(latents[:, :rank])
            mla_prefill(q[nd:, :, :nope], q_pe[nd:].contiguous(), k_nope, latents[:, rank:], v,
                        meta.prefill_cu_seqlens_q, cu_k, self.scale, meta.prefill_max_seqlen_q, out=out[nd:])
        return out
