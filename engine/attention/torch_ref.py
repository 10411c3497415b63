"""Reference attention in plain torch over the paged pool: the CPU path and the kernels' oracle."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionMetadata
from engine.kv_pool import KVPool


@dataclass(slots=True)
class _Plan:
    """Gather indices computed once per step, reused by every layer."""

    decode_slots: torch.Tensor  # [num_decodes, max_len] int64 (padding points at slot 0)
    decode_mask: torch.Tensor  # [num_decodes, 1, 1, max_len] bool, True = attend
    prefill_slots: list[torch.Tensor]  # per prefill: [seq_len] int64
    prefill_masks: list[torch.Tensor]  # per prefill: [q_len, seq_len] bool


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
    prefill_slots, prefill_masks = [], []
    for i, (q_len, n) in enumerate(zip(meta.prefill_q_lens_host, meta.prefill_seq_lens_host)):
        prefill_slots.append(_slots(meta.prefill_block_tables[i], n, block_size))
        q_pos = torch.arange(n - q_len, n, device=device)
        prefill_masks.append(torch.arange(n, device=device)[None, :] <= q_pos[:, None])
    return _Plan(decode_slots, decode_mask, prefill_slots, prefill_masks)


class _TorchStep:
    def __init__(self, meta: AttentionMetadata, pool: KVPool, scale: float, plan: _Plan) -> None:
        self.meta, self.pool, self.scale, self.plan = meta, pool, scale, plan

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.pool.layer(layer_idx)
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_flat = k_cache.view(-1, num_kv_heads, head_dim)
        v_flat = v_cache.view(-1, num_kv_heads, head_dim)
        k_flat.index_copy_(0, self.meta.slot_mapping, k.to(k_flat.dtype))
        v_flat.index_copy_(0, self.meta.slot_mapping, v.to(v_flat.dtype))

        out = torch.empty_like(q)
        nd = self.meta.num_decodes
        if nd:
            # [B, H, 1, D] queries against [B, Hkv, max_len, D] padded context.
            keys = k_flat[self.plan.decode_slots].transpose(1, 2)
            values = v_flat[self.plan.decode_slots].transpose(1, 2)
            out[:nd] = F.scaled_dot_product_attention(
                q[:nd].unsqueeze(2), keys, values, attn_mask=self.plan.decode_mask,
                scale=self.scale, enable_gqa=True,
            ).squeeze(2)
        start = nd
        for slots, mask, q_len in zip(self.plan.prefill_slots, self.plan.prefill_masks, self.meta.prefill_q_lens_host):
            qs = q[start:start + q_len].transpose(0, 1)  # [H, q_len, D]
            keys = k_flat[slots].transpose(0, 1)  # [Hkv, seq_len, D]
            values = v_flat[slots].transpose(0, 1)
            out[start:start + q_len] = F.scaled_dot_product_attention(
                qs, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True,
            ).transpose(0, 1)
            start += q_len
        return out
