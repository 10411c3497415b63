"""The paged KV pool: one tensor holding every layer's K and V blocks.

Layout (shared contract with kernels/ and kv_transport/):

    kv: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]

`kv[layer, 0]` is that layer's K cache and `kv[layer, 1]` its V cache, each
`[num_blocks, block_size, num_kv_heads, head_dim]` and contiguous. A token at
position `p` of a sequence lives in block `block_table[p // block_size]` at
offset `p % block_size`; its flat slot is `block_id * block_size + offset`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Everything two workers must agree on to exchange KV blocks. Under tensor parallelism
    a pool holds `num_kv_heads` of the model's KV heads from `kv_head_start` on."""

    model: str
    dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    tp_size: int = 1  # ranks the model is split over (engine.parallel)
    kv_head_start: int = 0  # the model's index of this pool's first KV head

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "tp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVLayout.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers, K and V."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


class KVPool:
    """Owns the KV tensor of one worker. Block bookkeeping lives in BlockManager."""

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device | str) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.layout = layout
        self.num_blocks = num_blocks
        # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]. Zeroed, and only
        # ever written with K/V: the Hopper prefill kernel reads whole blocks, slots past a
        # sequence's end included (masked, but 0 x NaN would still reach its output).
        self.kv = torch.zeros(
            layout.num_layers, 2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim,
            dtype=layout.dtype, device=device,
        )

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of one layer, each [num_blocks, block_size, num_kv_heads, head_dim]."""
        return self.kv[layer_idx, 0], self.kv[layer_idx, 1]
