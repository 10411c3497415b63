"""Block bookkeeping for the paged KV pool: pure Python, no torch.

Blocks are reference counted. A block whose count drops to zero goes to the
free queue, but if it holds a full, hashed block it stays findable by its hash
until it is reused (LRU eviction): a later request with the same prefix takes
it back instead of recomputing it. Freed blocks without a hash are reused first.

Given a `KVEventRecorder`, it reports every change of what its hashes find (a block stored,
one evicted, all cleared): the router's index of the cluster's caches is built from them.

Given tiers below the pool (`LowerTiers`: host memory and disk, `engine/kv/tiers.py`), a
prefix hit goes on below the pool (`match_lower`) and every cached block it evicts is kept
for the caller to copy down (`take_evicted`) before the block's new owner writes it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as SequenceT
from typing import Protocol

from pdserve.engine.kv.events import DEVICE_TIER, AllBlocksCleared, BlockRemoved, BlockStored, KVEventRecorder
from pdserve.engine.sequence import Sequence


class LowerTiers(Protocol):
    """Tiers below the pool, as the block manager sees them (no torch here)."""

    def fetch(self, block_hashes: list[int]) -> SequenceT[object]:
        """Whatever the tiers hold for the longest leading run of `block_hashes`."""
        ...


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 events: KVEventRecorder | None = None, lower: LowerTiers | None = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.events = events
        self.lower = lower
        self._evicted: list[tuple[int, int]] = []  # (block id, hash) evicted since take_evicted
        self._ref_counts = [0] * num_blocks
        self._hash_of_block: list[int | None] = [None] * num_blocks
        self._block_of_hash: dict[int, int] = {}
        # Blocks with no reference, in eviction order (front is evicted first).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # of which found

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (cached blocks nobody holds included)."""
        return len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def num_blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks `seq` needs to hold its first `num_tokens` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_ids))

    # Prefix cache --------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest prefix of a sequence that holds no blocks.

        At least one token is always left to compute, so the step that admits
        the sequence still produces its next-token logits.
        """
        assert not seq.block_ids, "match_prefix is for sequences that hold no blocks"
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        for h in seq.block_hashes((seq.num_tokens - 1) // self.block_size):
            block_id = self._block_of_hash.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        self.num_prefix_queries += seq.num_tokens
        self.num_prefix_hits += len(hits) * self.block_size
        return hits

    def match_lower(self, seq: Sequence, num_device_blocks: int) -> list[object]:
        """The blocks below the pool that continue `seq`'s prefix hit of `num_device_blocks`
        pool blocks (at least one token left to compute, as in `match_prefix`). The caller
        allocates a block for each, copies it in, and counts its tokens as computed."""
        if self.lower is None or not self.enable_prefix_caching:
            return []
        hashes = seq.block_hashes((seq.num_tokens - 1) // self.block_size)[num_device_blocks:]
        found = list(self.lower.fetch(hashes)) if hashes else []
        self.num_prefix_hits += len(found) * self.block_size
        return found

    def take_evicted(self) -> list[tuple[int, int]]:
        """(block id, hash) of each cached block evicted since the last call (only with tiers
        below): their KV is still in the pool until the new owner's first write."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish the hashes of `seq`'s full blocks whose KV has been computed (or queued:
        the step computing it precedes every step that could read it) and whose tokens are known."""
        if not self.enable_prefix_caching:
            return
        num_full = min(min(seq.num_computed_tokens, seq.num_known_tokens) // self.block_size, len(seq.block_ids))
        first = seq.num_published_blocks
        if num_full <= first:
            return
        hashes = seq.block_hashes(num_full)
        stored: list[BlockStored] = []
        for i in range(first, num_full):
            block_id, h = seq.block_ids[i], hashes[i]
            if self._hash_of_block[block_id] is None and h not in self._block_of_hash:
                self._hash_of_block[block_id] = h
                self._block_of_hash[h] = block_id
                stored.append(BlockStored(h, hashes[i - 1] if i else None))
        seq.num_published_blocks = num_full
        if self.events is not None:
            self.events.record(stored)

    def cached_hashes(self) -> tuple[int, ...]:
        """The hashes every cached block is found by (a snapshot of what the events built)."""
        return tuple(self._block_of_hash)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, so that no later prompt finds one (a cold start for a
        benchmark, or after the weights changed). Only while no block is held (as vLLM's
        reset): False, changing nothing, otherwise."""
        if len(self._free) < self.num_blocks:
            return False
        for block_id in self._block_of_hash.values():
            self._hash_of_block[block_id] = None
        self._block_of_hash.clear()
        if self.events is not None:
            self.events.record([AllBlocksCleared(DEVICE_TIER)])
        return True

    # Allocation ----------------------------------------------------------

    def can_allocate(self, seq: Sequence, num_new_tokens: int, prefix_block_ids: list[int] = ()) -> bool:
        """Whether `allocate(seq, num_new_tokens, prefix_block_ids)` would succeed."""
        return self._num_to_take(seq, num_new_tokens, prefix_block_ids) <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int, prefix_block_ids: list[int] = ()) -> bool:
        """Give `seq` blocks for `num_new_tokens` more tokens; all or nothing.

        prefix_block_ids: cached blocks from `match_prefix`, taken first; the
        caller then counts their tokens as computed.
        Returns False (and changes nothing) when too few blocks are free.
        """
        if not self.can_allocate(seq, num_new_tokens, prefix_block_ids):
            return False
        for block_id in prefix_block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1
            seq.block_ids.append(block_id)
        total = seq.num_computed_tokens + len(prefix_block_ids) * self.block_size + num_new_tokens
        for _ in range(self.num_blocks_needed(seq, total)):
            seq.block_ids.append(self._take_free_block())
        return True

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references. Tail blocks are freed first so they are evicted first."""
        for block_id in reversed(seq.block_ids):
            self._drop_ref(block_id)
        seq.block_ids.clear()
        seq.block_table_version += 1
        seq.num_published_blocks = 0

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free `seq`'s blocks past those holding its first `num_tokens` tokens.

        Speculation allocates slots for every proposed token; the rejected ones'
        KV is garbage, and blocks holding only such slots go back to the pool.
        """
        num_keep = -(-num_tokens // self.block_size)
        if len(seq.block_ids) <= num_keep:
            return
        while len(seq.block_ids) > num_keep:
            self._drop_ref(seq.block_ids.pop())
        seq.block_table_version += 1
        seq.num_published_blocks = min(seq.num_published_blocks, num_keep)

    def _drop_ref(self, block_id: int) -> None:
        count = self._ref_counts[block_id] - 1
        if count < 0:
            raise RuntimeError(f"block {block_id} freed more often than allocated")
        self._ref_counts[block_id] = count
        if count == 0:
            self._free[block_id] = None
            if self._hash_of_block[block_id] is None:  # nothing to find it by: reuse it first
                self._free.move_to_end(block_id, last=False)

    def _num_to_take(self, seq: Sequence, num_new_tokens: int, prefix_block_ids: list[int]) -> int:
        num_revived = sum(1 for b in prefix_block_ids if self._ref_counts[b] == 0)
        total = seq.num_computed_tokens + len(prefix_block_ids) * self.block_size + num_new_tokens
        num_held = len(seq.block_ids) + len(prefix_block_ids)
        return num_revived + max(0, -(-total // self.block_size) - num_held)

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        h = self._hash_of_block[block_id]
        if h is not None:  # evict the cached content
            self._hash_of_block[block_id] = None
            del self._block_of_hash[h]
            if self.events is not None:
                self.events.record([BlockRemoved(h)])
            if self.lower is not None:
                self._evicted.append((block_id, h))
        self._ref_counts[block_id] = 1
        return block_id
