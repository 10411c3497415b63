"""The paged KV pool: one tensor holding every layer's KV blocks.

Layout (shared contract with kernels/ and kv_transport/):

    kv: [num_layers, num_entries, num_blocks, block_size, num_kv_heads, head_dim]

What a token's entry is, `KVLayout.kind` says:
- "kv" (GQA): num_entries 2, `kv[layer, 0]` that layer's K cache and `kv[layer, 1]` its V
  cache, each `[num_blocks, block_size, num_kv_heads, head_dim]` and contiguous (`layer`).
- "mla" (multi-head latent attention, DeepSeek-V2/V3): num_entries 1, num_kv_heads 1, and
  head_dim the latent's width, kv_lora_rank + qk_rope_head_dim (V3: 512 + 64 = 576): the
  first kv_lora_rank values the compressed KV after `kv_a_layernorm`, the last the rotated
  k_pe, as vLLM and FlashMLA store it. `latent(layer)` is `[num_blocks, block_size,
  latent_dim]`, the view the MLA kernels read. Every tensor-parallel rank holds all of it.
One shape for both keeps the tiers, the disk files and the transport, which index
`kv[layer, entry, block]`, unaware of the kind. A token at position `p` of a sequence lives
in block `block_table[p // block_size]` at offset `p % block_size`; its flat slot is
`block_id * block_size + offset`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_KINDS = ("kv", "mla")


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Everything two workers must agree on to exchange KV blocks. Under tensor parallelism
    a "kv" pool holds `num_kv_heads` of the model's KV heads from `kv_head_start` on; an
    "mla" pool is one latent "head" (head_dim wide) on every rank."""

    model: str
    dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    tp_size: int = 1  # ranks the model is split over (engine.parallel)
    kv_head_start: int = 0  # the model's index of this pool's first KV head
    kind: str = "kv"  # what a token's entry is: K and V per KV head, or one latent ("mla")

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "tp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVLayout.{name} must be >= 1, got {getattr(self, name)}")
        if self.kind not in KV_KINDS:
            raise ValueError(f"KVLayout.kind must be one of {KV_KINDS}, got {self.kind!r}")
        if self.kind == "mla" and (self.num_kv_heads != 1 or self.kv_head_start != 0):
            raise ValueError(f"an mla KVLayout holds one latent per token: num_kv_heads must be 1 and "
                             f"kv_head_start 0, got {self.num_kv_heads} and {self.kv_head_start}")

    @property
    def num_entries(self) -> int:
        """Tensors per token and layer: K and V (2), or the latent (1)."""
        return 1 if self.kind == "mla" else 2

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token's entries across all layers (K and V of each KV head, or the latent)."""
        return self.bytes_per_block // self.block_size

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers and entries."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_entries * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


class KVPool:
    """Owns the KV tensor of one worker. Block bookkeeping lives in BlockManager."""

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device | str) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.layout = layout
        self.num_blocks = num_blocks
        # [num_layers, num_entries, num_blocks, block_size, num_kv_heads, head_dim]. Zeroed, and
        # only ever written with KV: the Hopper prefill kernel reads whole blocks, slots past a
        # sequence's end included (masked, but 0 x NaN would still reach its output).
        self.kv = torch.zeros(
            layout.num_layers, layout.num_entries, num_blocks, layout.block_size, layout.num_kv_heads,
            layout.head_dim, dtype=layout.dtype, device=device,
        )

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of one layer, each [num_blocks, block_size, num_kv_heads, head_dim]."""
        if self.layout.kind != "kv":
            raise ValueError(f"a {self.layout.kind!r} pool has no separate K and V caches: use latent()")
        return self.kv[layer_idx, 0], self.kv[layer_idx, 1]

    def latent(self, layer_idx: int) -> torch.Tensor:
        """An mla pool's latent cache of one layer, [num_blocks, block_size, latent_dim] (contiguous)."""
        if self.layout.kind != "mla":
            raise ValueError(f"a {self.layout.kind!r} pool holds K and V, no latent: use layer()")
        return self.kv[layer_idx, 0, :, :, 0]
