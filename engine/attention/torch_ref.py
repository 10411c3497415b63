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
from pdserve.engine.attention.decode_mirror import DecodeMirror
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
    """Gather indices computed once per step, reused by every layer. Context is read a whole
    block at a time (`_context`): a block's rows are one contiguous run of the pool, so the
    gather copies runs of block_size rows (`_context`; 2-4x faster on the CPU than row by row),
    and the plan needs no loop over the sequences."""

    decode_blocks: torch.Tensor  # [num_decodes, max_blocks] int64, the blocks that hold max_len
    decode_mask: torch.Tensor  # [num_decodes, 1, 1, max_blocks * block_size] bool, True = attend
    # Per prefill chunk, (its blocks, the length) of its earlier context; None when it has
    # none (the chunk's own k, v are all it attends to).
    prefill_context: list[tuple[torch.Tensor, int] | None]


class TorchAttention:
    """The plain-torch backend. Decode steps read their context through a `DecodeMirror`
    (one token a sequence appended per step, not the whole context gathered again)."""

    def __init__(self) -> None:
        self.mirror = DecodeMirror()

    def begin_step(self, meta: AttentionMetadata, pool: KVPool, scale: float) -> _TorchStep:
        # On the CPU, over a pool of the model's dtype (an FP8 pool's values are widened
        # each step: the gather stays).
        mirrored = pool.kv.device.type == "cpu" and pool.layout.dtype != fp8.KV_FP8 and self.mirror.begin(meta, pool)
        return _TorchStep(meta, pool, scale, _plan(meta, pool.layout.block_size), self.mirror if mirrored else None)


def _plan(meta: AttentionMetadata, block_size: int) -> _Plan:
    num_blocks = -(-max(meta.decode_seq_lens_host, default=0) // block_size)
    decode_blocks = meta.decode_block_tables[:, :num_blocks].long()
    pos = torch.arange(num_blocks * block_size, device=decode_blocks.device)
    decode_mask = (pos < meta.decode_seq_lens[:, None]).view(meta.num_decodes, 1, 1, pos.shape[0])
    context = [(meta.prefill_block_tables[i, :-(-(n - q_len) // block_size)].long(), n - q_len) if n > q_len else None
               for i, (q_len, n) in enumerate(zip(meta.prefill_q_lens_host, meta.prefill_seq_lens_host))]
    return _Plan(decode_blocks, decode_mask, context)


def _context(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The rows of `blocks` of cache [num_blocks, block_size, ...], in order, as one tensor
    [..., len(blocks) * block_size, ...] (a copy: leading dims of blocks kept, the block and
    offset dims merged). `index_select` of whole blocks copies at memcpy speed on the CPU
    (2.6x advanced indexing's `cache[blocks]` in bf16)."""
    rows = cache.view(cache.shape[0], -1).index_select(0, blocks.reshape(-1))
    return rows.view(*blocks.shape[:-1], -1, *cache.shape[2:])


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
    def __init__(self, meta: AttentionMetadata, pool: KVPool, scale: float, plan: _Plan,
                 mirror: DecodeMirror | None) -> None:
        self.meta, self.pool, self.scale, self.plan, self.mirror = meta, pool, scale, plan, mirror

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 rope: Rope, head_norm: HeadNorm | None = None) -> torch.Tensor:
        if head_norm is not None:
            q, k = head_norm(q, k)
        q, k = rope(q, k)
        k_cache, v_cache = self.pool.layer(layer_idx)
        k_flat = k_cache.view(-1, *k_cache.shape[2:])
        v_flat = v_cache.view(-1, *v_cache.shape[2:])
        # Attention reads the new k, v as the pool holds them (its dtype may differ from the
        # model's: an FP8 pool's values are rounded, then widened back to q's dtype).
        k = write_slots(k_flat, self.meta.slot_mapping, k).to(q.dtype)
        v = write_slots(v_flat, self.meta.slot_mapping, v).to(q.dtype)

        outs = []  # [tokens, H, D] per part of the step, in token order
        nd = self.meta.num_decodes
        if nd:
            # [B, H, 1, D] queries against [B, Hkv, max_len, D] padded context.
            if self.mirror is not None and k.dtype == k_cache.dtype:
                keys, values = self.mirror.context(layer_idx, k_cache, v_cache, self.plan.decode_blocks, k[:nd], v[:nd])
            else:
                keys, values = _context(k_cache, self.plan.decode_blocks), _context(v_cache, self.plan.decode_blocks)
            keys, values = keys.to(q.dtype).transpose(1, 2), values.to(q.dtype).transpose(1, 2)
            outs.append(F.scaled_dot_product_attention(
                q[:nd].unsqueeze(2), keys, values, attn_mask=self.plan.decode_mask,
                scale=self.scale, enable_gqa=True,
            ).squeeze(2))
        start = nd
        for context, q_len in zip(self.plan.prefill_context, self.meta.prefill_q_lens_host):
            end = start + q_len
            qs, ks, vs = _heads_first(q[start:end]), _heads_first(k[start:end]), _heads_first(v[start:end])
            if context is None:
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.scale, enable_gqa=True)
            else:
                blocks, n = context
                o = _attend_after_context(qs, _heads_first(_context(k_cache, blocks)[:n].to(q.dtype)),
                                          _heads_first(_context(v_cache, blocks)[:n].to(q.dtype)), ks, vs, self.scale)
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
            latents = _context(cache, self.plan.decode_blocks).to(q.dtype)  # [B, max_len, latent_dim]
            outs.append(mla_absorbed(q[:nd], latents, self.plan.decode_mask, projection, self.scale))
        start = nd
        for context, q_len in zip(self.plan.prefill_context, self.meta.prefill_q_lens_host):
            end = start + q_len
            latents = entries[start:end]
            n = 0
            if context is not None:
                blocks, n = context
                latents = torch.cat((_context(cache, blocks)[:n].to(q.dtype), latents))
            outs.append(mla_expanded(q[start:end], latents, projection, n, self.scale))
            start = end
        return outs[0] if len(outs) == 1 else torch.cat(outs)
