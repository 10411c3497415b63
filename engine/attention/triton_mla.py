"""Multi-head latent attention on CUDA through `kernels.mla_decode` and `kernels.mla_prefill`.

The step's new latents ([c_kv | k_pe], k_pe rotated) are written into the layer's latent
cache first. Decodes then attend in the absorbed form (q_nope @ W_UK, the kernel's output
in the latent space, then W_UV); prefill chunks (and verifications) gather their sequences'
whole latents from the cache (the cached prefix and the chunk), expand them through
kv_b_proj and attend causally (`mla_prefill`, a value narrower than the key). These steps
run eagerly: the decode launch allocates its split-K workspace (`assembly` captures no
graphs for a latent pool).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pdserve.engine.attention.base import AttentionMetadata
from pdserve.engine.attention.torch_ref import write_slots
from pdserve.engine.kv.pool import KVPool
from pdserve.engine.models.rope import Rope
from pdserve.kernels.mla_decode import mla_decode
from pdserve.kernels.mla_prefill import mla_prefill

if TYPE_CHECKING:
    from pdserve.engine.models.layers import HeadNorm, MLAProjection


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
        self.prefill = _prefill_slots(meta, pool.layout.block_size) if meta.num_prefills else None

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 rope: Rope, head_norm: HeadNorm | None = None) -> torch.Tensor:
        raise ValueError("a latent (mla) KV pool holds no per-head K and V: the model must call AttentionStep.mla")

    def mla(self, layer_idx: int, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, rope: Rope,
            projection: MLAProjection) -> torch.Tensor:
        meta, nope = self.meta, projection.qk_nope_head_dim
        q_pe, k_pe = rope(q[..., nope:], k_pe.unsqueeze(1))
        cache = self.pool.latent(layer_idx)  # [num_blocks, block_size, latent_dim]
        flat = cache.view(-1, cache.shape[-1])
        write_slots(flat, meta.slot_mapping, torch.cat((kv_c, k_pe[:, 0]), dim=-1))
        out = q.new_empty(q.shape[0], q.shape[1], projection.v_head_dim)
        nd = meta.num_decodes
        if nd:
            w_uk, w_uv = projection.absorbed(q.dtype)
            q_latent = torch.einsum("thn,hnr->thr", q[:nd, :, :nope], w_uk)
            o_latent = mla_decode(q_latent, q_pe[:nd].contiguous(), cache, meta.decode_block_tables,
                                  meta.decode_seq_lens, self.scale)
            out[:nd] = torch.einsum("thr,hvr->thv", o_latent, w_uv)
        if self.prefill is not None:
            slots, cu_k = self.prefill
            latents = flat[slots].to(q.dtype)
            rank = latents.shape[-1] - q_pe.shape[-1]
            k_nope, v = projection.expand(latents[:, :rank])
            mla_prefill(q[nd:, :, :nope], q_pe[nd:].contiguous(), k_nope, latents[:, rank:], v,
                        meta.prefill_cu_seqlens_q, cu_k, self.scale, meta.prefill_max_seqlen_q, out=out[nd:])
        return out
