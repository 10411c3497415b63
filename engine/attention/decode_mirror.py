"""The CPU's decode context kept from one step to the next, so a decode step appends one
token a sequence instead of gathering every sequence's whole context again.

`TorchAttention` attends a decode batch over a padded copy of each sequence's context,
gathered block by block out of the paged pool ([B, max_len, Hkv, D] per layer, K and V):
at 32 sequences of ~300 tokens that gather copied ~240 MB a step for SmolLM2-135M, a fifth
of a CPU decode step. Consecutive decode steps mostly run the same sequences, each one
token longer, whose earlier KV never changes; the mirror keeps each layer's gathered K and
V (with room for more tokens) and writes only the step's new token into it. Any other
step (a sequence joined, left or was reordered, a table was freed or trimmed, the context
outgrew the room, another pool) gathers afresh, as before.

The mirror's bytes are bounded (`budget_bytes`, at most a quarter of the pool's by
default): past the bound the decodes gather every step, as before. The pool stays the
KV's one home; the mirror is a copy the attention reads, never written back."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.attention.base import AttentionMetadata
from pdserve.engine.kv.pool import KVPool

# Blocks of room past the longest context a fresh gather leaves: it copies that much more
# than a plain gather (a step whose batch changed pays it), and the batch gathers afresh
# when the longest context outgrows it (every ROOM_BLOCKS * block_size steps at most).
ROOM_BLOCKS = 2


@dataclass(frozen=True, slots=True)
class _Key:
    """What a step's decode rows are: the pool, each row's block table (one id per
    sequence and table version, `AttentionMetadata.decode_table_ids`) and its length."""

    pool: int
    table_ids: tuple[int, ...]
    lens: tuple[int, ...]


class DecodeMirror:
    """Per layer, K and V [B, room, Hkv, D] of the last decode step's sequences."""

    def __init__(self, budget_fraction: float = 0.25) -> None:
        self.budget_fraction = budget_fraction
        self._key: _Key | None = None
        self._room = 0  # tokens of each row's buffers
        self._appending = False  # this step continues the last: buffers take its new tokens
        self._last: _Key | None = None  # the step before this one (what appending buffers hold)
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor, _Key]] = {}  # and the step they hold
        self._rows = torch.empty(0, dtype=torch.int64)  # this step's flat row of each new token

    def begin(self, meta: AttentionMetadata, pool: KVPool) -> bool:
        """Plan this step's decodes; False: no mirror for them (gather as before)."""
        lens = tuple(meta.decode_seq_lens_host)
        if not meta.decode_table_ids or not lens or pool.layout.kind != "kv":
            self._drop()
            return False
        key = _Key(id(pool), meta.decode_table_ids, lens)
        bs = pool.layout.block_size
        self._last = self._key
        self._appending = (self._key == _Key(key.pool, key.table_ids, tuple(n - 1 for n in lens))
                           and -(-max(lens) // bs) * bs <= self._room)
        if not self._appending:
            self._kv.clear()
            blocks = -(-max(lens) // bs)
            self._room = (blocks + ROOM_BLOCKS) * bs
            layout = pool.layout
            mirror_bytes = (2 * layout.num_layers * len(lens) * self._room * layout.num_kv_heads * layout.head_dim
                            * pool.kv.element_size())
            if mirror_bytes > self.budget_fraction * pool.kv.numel() * pool.kv.element_size():
                self._drop()
                return False
        self._key = key
        rows = torch.arange(len(lens), dtype=torch.int64) * self._room
        self._rows = rows + torch.tensor(lens, dtype=torch.int64) - 1
        return True

    def _drop(self) -> None:
        self._key, self._last, self._room, self._appending = None, None, 0, False
        self._kv.clear()

    def context(self, layer_idx: int, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
                k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's decode context (K, V [B, blocks * block_size, Hkv, D] views): its
        buffers with the step's new k_new, v_new [B, Hkv, D] written in, or (a fresh step)
        gathered from k_cache, v_cache [num_blocks, block_size, Hkv, D] through `blocks`
        [B, num_blocks] (the step's new tokens already in the pool)."""
        held = self._kv.get(layer_idx)
        if self._appending and held is not None and held[2] is self._last:
            keys, values, _ = held
            for buf, new in ((keys, k_new), (values, v_new)):
                buf.view(-1, *buf.shape[2:]).index_copy_(0, self._rows, new)
        else:
            keys, values = _gather(k_cache, blocks, self._room), _gather(v_cache, blocks, self._room)
        assert self._key is not None
        self._kv[layer_idx] = (keys, values, self._key)
        length = blocks.shape[1] * k_cache.shape[1]
        return keys[:, :length], values[:, :length]


def _gather(cache: torch.Tensor, blocks: torch.Tensor, room: int) -> torch.Tensor:
    """The rows of `blocks` [B, n] of cache [num_blocks, block_size, ...] as [B, room, ...]:
    the first n blocks' rows, then room for more (copies of block 0, never read unmasked)."""
    bs = cache.shape[1]
    padded = torch.zeros(blocks.shape[0], room // bs, dtype=blocks.dtype)
    padded[:, :blocks.shape[1]] = blocks
    rows = cache.view(cache.shape[0], -1).index_select(0, padded.view(-1))
    return rows.view(blocks.shape[0], room, *cache.shape[2:])
