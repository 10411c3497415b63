"""Multi-head latent attention in plain torch over latents gathered from the pool: the CPU
path (`torch_ref`) and the oracle of the MLA kernels.

A latent entry is [kv_c | k_pe] (kv_lora_rank + qk_rope_head_dim values, `KVLayout` kind
"mla"), k_pe already rotated. Two equal forms:
- expanded (prefill): kv_b_proj turns each latent into every head's k_nope and v; keys are
  [k_nope | k_pe], queries [q_nope | q_pe]: ordinary attention with a value narrower than
  the key, transformers' arithmetic.
- absorbed (decode): q_nope @ W_UK is the query in latent space, so the scores are one dot
  product of [q_latent | q_pe] with the whole entry, the output is the scores' mix of the
  kv_c parts, then W_UV maps it to each head's value: kv_b_proj never runs over the context.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from pdserve.engine.models.layers import MLAProjection


def mla_expanded(q: torch.Tensor, latents: torch.Tensor, projection: MLAProjection, context: int,
                 scale: float) -> torch.Tensor:
    """Causal attention of a chunk's queries over `context` earlier tokens and its own.

    q: [q_len, H, qk_nope + qk_rope] (rope part rotated); latents: [context + q_len, latent_dim]
    entries in token order -> [q_len, H, v_head_dim]. Query i sees the context and the chunk's
    tokens 0..i."""
    rank = latents.shape[-1] - (q.shape[-1] - projection.qk_nope_head_dim)
    k_nope, v = projection.expand(latents[:, :rank])
    k_pe = latents[:, None, rank:].expand(-1, k_nope.shape[1], -1)
    k = torch.cat((k_nope, k_pe), dim=-1)
    q_len = q.shape[0]
    mask = torch.ones(q_len, context + q_len, dtype=torch.bool, device=q.device).tril(context)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                       attn_mask=mask, scale=scale)
    return o.transpose(0, 1)


def mla_absorbed(q: torch.Tensor, latents: torch.Tensor, mask: torch.Tensor, projection: MLAProjection,
                 scale: float) -> torch.Tensor:
    """One query per sequence over its padded context, in the absorbed form.

    q: [B, H, qk_nope + qk_rope] (rope part rotated); latents: [B, L, latent_dim]; mask:
    [B, 1, 1, L] bool, True = attend -> [B, H, v_head_dim]."""
    w_uk, w_uv = projection.absorbed(q.dtype)  # [H, nope, rank], [H, v, rank]
    nope, rank = projection.qk_nope_head_dim, w_uk.shape[-1]
    q_latent = torch.einsum("bhn,hnr->bhr", q[..., :nope], w_uk)
    q_entry = torch.cat((q_latent, q[..., nope:]), dim=-1).unsqueeze(2)  # [B, H, 1, latent_dim]
    entries = latents.unsqueeze(1)  # [B, 1, L, latent_dim]: one "KV head" every query head reads
    o_latent = F.scaled_dot_product_attention(q_entry, entries, entries[..., :rank], attn_mask=mask, scale=scale,
                                              enable_gqa=True).squeeze(2)  # [B, H, rank]
    return torch.einsum("bhr,hvr->bhv", o_latent, w_uv)
