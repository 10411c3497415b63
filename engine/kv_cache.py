"""A node's KV cache as the router sees it: the pool's blocks (the block manager, with its
prefix cache), the host and disk tiers below the pool, and the KV events both record.

The step core calls it around each step (evicted blocks copied down before their new
owner writes them, tier hits copied in before the step reads them); the load report and
the snapshot read its events.
"""

from __future__ import annotations

from typing import cast

from pdserve.engine.config import EngineConfig
from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.kv.events import DEVICE_TIER, DISK_TIER, HOST_TIER, KVEventRecorder, KVSnapshot
from pdserve.engine.kv.pool import KVPool
from pdserve.engine.kv.tiers import KVTiers, TierHit
from pdserve.engine.scheduler import ScheduledBatch


class KVCache:
    def __init__(self, config: EngineConfig, pool: KVPool, model_digest: str) -> None:
        # What the prefix cache stored and evicted, for the router (taken with each load report).
        self.events = KVEventRecorder(config.cache.kv_events_max_pending)
        # Host memory and disk below the pool (None: neither configured).
        self.tiers = KVTiers(config.kv_tiers, pool, model_digest) if config.kv_tiers.enabled else None
        self.block_manager = BlockManager(pool.num_blocks, pool.layout.block_size,
                                          config.cache.enable_prefix_caching, self.events, self.tiers)

    def before_step(self, batch: ScheduledBatch) -> None:
        """The batch's blocks found in the tiers copied into the pool before the step reads them."""
        if self.tiers is None:
            return
        self.offload_evicted()  # first: an onboarded block may reuse an evicted one
        self.tiers.onboard(cast(list[tuple[int, TierHit]], batch.onboard))
        self.record_tier_events()

    def offload_evicted(self, wait: bool = False) -> None:
        """Copy the blocks the last allocations evicted down to the tiers, before anyone writes them."""
        if self.tiers is not None:
            self.tiers.offload(self.block_manager.take_evicted(), wait)

    def record_tier_events(self) -> None:
        """The tiers' events (mostly made on their offload thread) into the recorder, on this thread."""
        if self.tiers is not None:
            self.events.record(self.tiers.take_events())

    def snapshot(self) -> KVSnapshot:
        """Every block the prefix cache and the tiers below hold now, as of the KV events recorded so far."""
        hashes = {DEVICE_TIER: self.block_manager.cached_hashes()}
        if self.tiers is not None:
            events, tier_hashes = self.tiers.snapshot()
            self.events.record(events)
            hashes.update(tier_hashes)
        return self.events.snapshot(hashes)

    def wipe_tiers(self, tiers: tuple[str, ...] = (HOST_TIER, DISK_TIER)) -> bool:
        """Drop every block of the host and/or disk tier (their files too); False without tiers."""
        if self.tiers is None:
            return False
        self.tiers.wipe(tiers)
        self.record_tier_events()
        return True
