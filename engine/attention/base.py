"""What every attention backend receives for one step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.engine.kv.pool import KVPool
from pdserve.engine.models.layers import AttentionStep


@dataclass(slots=True)
class AttentionMetadata:
    """The step's tokens: decode sequences first (one token each), then prefill chunks.

    Device tensors are used by kernels; the host lists by planning code.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64, flat KV slot of each new token
    num_decodes: int  # the first num_decodes tokens are one-token decodes
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    decode_seq_lens: torch.Tensor  # [num_decodes] int32, context length incl. the new token
    prefill_cu_seqlens_q: torch.Tensor  # [num_prefills + 1] int32, offsets from token num_decodes
    prefill_seq_lens: torch.Tensor  # [num_prefills] int32, context length incl. the chunk
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32
    prefill_max_seqlen_q: int
    decode_seq_lens_host: list[int]
    prefill_q_lens_host: list[int]
    prefill_seq_lens_host: list[int]
    # One host id per decode row naming its sequence's block table while the table only grows
    # (a new sequence, or its blocks freed or trimmed, gets a new id): equal ids at two steps
    # are the same sequence over the same earlier blocks. Empty where not built (graphs).
    decode_table_ids: tuple[int, ...] = ()

    @property
    def num_prefills(self) -> int:
        return len(self.prefill_q_lens_host)


class AttentionBackend(Protocol):
    def begin_step(self, meta: AttentionMetadata, pool: KVPool, scale: float) -> AttentionStep:
        """Plan the step once; the returned callable runs each layer's attention:
        it writes the layer's new k, v into `pool` at `meta.slot_mapping`, then
        attends causally over each sequence's whole context."""
        ...
