"""Reference attention in plain torch over the paged pool: the CPU path and the kernels' oracle.

Attention runs on 4-D [batch, heads, tokens, head_dim] tensors: on the CPU only those reach
torch's fused flash kernel (3-D ones fall back to SDPA's math path, which materializes the
scores and runs 3-6x slower at 1-4k tokens). A prefill chunk with no earlier context (a
fresh prompt's first chunk) attends over its own new k, v with `is_causal=True`: no gather,
no mask, the masked half of the square skipped. A chunk after context (a later chunk, a
prefix hit, a speculative verification) needs its diagonal bottom-right, where
`is_causal` puts it top-left: see `_attend_after_context`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pdserve.engine.attention.base import AttentionMetadata
from pdserve.engine.attention.mla_ref import mla_absorbed, mla_expanded
from pdserve.engine.kv.pool import KVPool
from pdserve.engine.models.rope import Rope
from pdserve.kernels import fp8

if TYPE_CHECKING:
    from pdserve.engine.models.layers import HeadNorm, MLAProjection

# torch's CPU flash-attention kernel, which also returns the log-sum-exp of each query's
# scores (natural log, scaled) and broadcasts grouped KV heads as `enable_gqa` does.
_cpu_flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@dataclass(slots=True)
class _Plan:
    """Gather indices computed once per step, reused by every layer."""

    decode_slots: torch.Tensor  # [num_decodes, max_len] int64 (padding points at slot 0)
    decode_mask: torch.Tensor  # [num_decodes, 1, 1, max_len] bool, True = attend
    # Per prefill chunk, the slots [seq_len - q_len] int64 of its earlier context; None
    # when it has none (the chunk's own k, v are all it attends to).
    prefill_context_slots: list[torch.Tensor | None]


class TorchAttention:
    def begin_step(self, meta: AttentionMetadata, pool: KVPool, scale: float) -> _TorchStep:
        return _TorchStep(meta, pool, scale, _plan(meta, pool.layout.block_size))


def _slots(block_table: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(seq_len, device=block_table.device)
    return block_table[pos // block_size].long() * block_size + pos % block_size


def _plan(meta: AttentionMetadata, block_size: int) -> _Plan:
    device = meta.slot_mapping.device
    lens = meta.decode_seq_lens_host
    max_len = max(lens, default=0)
    decode_slots = torch.zeros(len(lens), max_len, dtype=torch.long, device=device)
    decode_mask = torch.zeros(len(lens), 1, 1, max_len, dtype=torch.bool, device=device)
    for i, n in enumerate(lens):
        decode_slots[i, :n] = _slots(meta.decode_block_tables[i], n, block_size)
        decode_mask[i, ..., :n] = True
    context_slots = [_slots(meta.prefill_block_tables[i], n - q_len, block_size) if n > q_len else None
                     for i, (q_len, n) in enumerate(zip(meta.prefill_q_lens_host, meta.prefill_seq_lens_host))]
    return _Plan(decode_slots, decode_mask, context_slots)


def write_slots(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, D] into rows `slots` of cache [slots, heads, D], in the cache's
    dtype (`kernels.fp8.quantize` for an FP8 cache, whose rows go in as bytes: torch has
    no index_copy_ for float8 on the CPU). Returns x as written."""
    if cache.dtype == fp8.KV_FP8:
        x = fp8.quantize(x)
        cache.view(torch.uint8).index_copy_(0, slots, x.view(torch.uint8))
        return x
    x = x.to(cache.dtype)
    cache.index_copy_(0, slots, x)
    return x


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[tokens, heads, D] -> a [1, heads, tokens, D] view."""
    return x.transpose(0, 1).unsqueeze(0)


def _attend_after_context(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, k_new: torch.Tensor,
                          v_new: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of a chunk's queries [1, H, q_len, D] over `context` earlier tokens'
    k_ctx, v_ctx [1, Hkv, context, D], then the chunk's own k_new, v_new [1, Hkv, q_len, D]:
    query i sees the context and the chunk's keys 0..i. -> [1, H, q_len, D]

    On the CPU, two flash calls: the whole context (no mask) and the chunk over itself
    (`is_causal`, its square's masked half skipped). Each output is normalized by its own
    softmax sum Z; the softmax over both key sets is their mix weighted by those sums,
    o_ctx * Z_ctx / (Z_ctx + Z_new) + o_new * Z_new / (Z_ctx + Z_new), i.e. a lerp by
    sigmoid(lse_ctx - lse_new). That is the least work (the kernels split the keys the same
    way) and builds no mask. Elsewhere (on CUDA, where this is the kernels' float64
    oracle) one call with an explicit mask.
    """
    if _cpu_flash is not None and q.device.type == "cpu":
        o_ctx, lse_ctx = _cpu_flash(q, k_ctx, v_ctx, 0.0, False, scale=scale)
        o_new, lse_new = _cpu_flash(q, k_new, v_new, 0.0, True, scale=scale)
        w_ctx = torch.sigmoid(lse_ctx - lse_new).unsqueeze(-1)  # [1, H, q_len, 1] float32 (or float64)
        return torch.lerp(o_new.to(w_ctx.dtype), o_ctx.to(w_ctx.dtype), w_ctx).to(q.dtype)
    context, q_len = k_ctx.shape[2], q.shape[2]
    mask = torch.ones(q_len, context + q_len, dtype=torch.bool, device=q.device).tril(context)
    return F.scaled_dot_product_attention(q, torch.cat([k_ctx, k_new], 2), torch.cat([v_ctx, v_new], 2),
                                          attn_mask=mask, scale=scale, enable_gqa=True)


class _TorchStep:
    def __init__(self, meta: AttentionMetadata, pool: KVPool, scale: float, plan: _Plan) -> None:
        self.meta, self.pool, self.scale, self.plan = meta, pool, scale, plan

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 rope: Rope, head_norm: HeadNorm | None = None) -> torch.Tensor:
        if head_norm is not None:
            q, k = head_norm(q, k)
        q, k = rope(q, k)
        k_cache, v_cache = self.pool.layer(layer_idx)
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_flat = k_cache.view(-1, num_kv_heads, head_dim)
        v_flat = v_cache.view(-1, num_kv_heads, head_dim)
        # Attention reads the new k, v as the pool holds them (its dtype may differ from the
        # model's: an FP8 pool's values are rounded, then widened back to q's dtype).
        k = write_slots(k_flat, self.meta.slot_mapping, k).to(q.dtype)
        v = write_slots(v_flat, self.meta.slot_mapping, v).to(q.dtype)

        outs = []  # [tokens, H, D] per part of the step, in token order
        nd = self.meta.num_decodes
        if nd:
            # [B, H, 1, D] queries against [B, Hkv, max_len, D] padded context.
            keys = k_flat[self.plan.decode_slots].to(q.dtype).transpose(1, 2)
            values = v_flat[self.plan.decode_slots].to(q.dtype).transpose(1, 2)
            outs.append(F.scaled_dot_product_attention(
                q[:nd].unsqueeze(2), keys, values, attn_mask=self.plan.decode_mask,
                scale=self.scale, enable_gqa=True,
            ).squeeze(2))
        start = nd
        for context_slots, q_len in zip(self.plan.prefill_context_slots, self.meta.prefill_q_lens_host):
            end = start + q_len
            qs, ks, vs = _heads_first(q[start:end]), _heads_first(k[start:end]), _heads_first(v[start:end])
            if context_slots is None:
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.scale, enable_gqa=True)
            else:
                o = _attend_after_context(qs, _heads_first(k_flat[context_slots].to(q.dtype)),
                                          _heads_first(v_flat[context_slots].to(q.dtype)), ks, vs, self.scale)
            outs.append(o.squeeze(0).transpose(0, 1))
            start = end
        # A step of one part (one prompt's chunk) returns it as is: the CPU kernel's output is
        # [1, H, q_len, D] over [q_len, H, D] memory, so this view is contiguous (no copy).
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def mla(self, layer_idx: int, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, rope: Rope,
            projection: MLAProjection) -> torch.Tensor:
        """Multi-head latent attention (`AttentionStep.mla`): decodes in the absorbed form,
        prefill chunks (and verifications) with the latents expanded (mla_ref.py)."""
        nope = projection.qk_nope_head_dim
        q_pe, k_pe = rope(q[..., nope:], k_pe.unsqueeze(1))
        q = torch.cat((q[..., :nope], q_pe), dim=-1)
        cache = self.pool.latent(layer_idx)
        flat = cache.view(-1, 1, cache.shape[-1])
        # Attention reads the new entries as the pool holds them (an FP8 pool's rounded).
        entries = write_slots(flat, self.meta.slot_mapping, torch.cat((kv_c.unsqueeze(1), k_pe), dim=-1))
        entries = entries[:, 0].to(q.dtype)
        outs = []
        nd = self.meta.num_decodes
        if nd:
            latents = flat[self.plan.decode_slots, 0].to(q.dtype)  # [B, max_len, latent_dim]
            outs.append(mla_absorbed(q[:nd], latents, self.plan.decode_mask, projection, self.scale))
        start = nd
        for context_slots, q_len in zip(self.plan.prefill_context_slots, self.meta.prefill_q_lens_host):
            end = start + q_len
            latents = entries[start:end]
            context = 0
            if context_slots is not None:
                latents = torch.cat((flat[context_slots, 0].to(q.dtype), latents))
                context = context_slots.shape[0]
            outs.append(mla_expanded(q[start:end], latents, projection, context, self.scale))
            start = end
        return outs[0] if len(outs) == 1 else torch.cat(outs)
