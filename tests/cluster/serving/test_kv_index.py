"""The router's global KV index: events applied in order, gaps and restarts repaired by snapshot."""

from __future__ import annotations

from pdserve.cluster.serving.kv_index import KVIndex
from pdserve.engine.kv.events import (
    DEVICE_TIER,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVSnapshot,
)


def test_stored_removed_and_cleared_build_the_map_from_hash_to_workers():
    index = KVIndex()
    assert index.apply("a", KVEventBatch("a1", 0, (BlockStored(1, None), BlockStored(2, 1), BlockStored(3, 2))))
    assert index.apply("b", KVEventBatch("b1", 0, (BlockStored(1, None), BlockStored(5, 1))))
    assert index.prefix_blocks([1, 2, 3, 4]) == {"a": 3, "b": 1}
    assert index.prefix_blocks([1, 5]) == {"a": 1, "b": 2}
    assert index.prefix_blocks([9, 1]) == {} and index.prefix_blocks([1], tier="host") == {}
    assert index.apply("a", KVEventBatch("a1", 3, (BlockRemoved(2),)))
    assert index.prefix_blocks([1, 2, 3]) == {"a": 1, "b": 1}
    assert len(index) == 4 and index.blocks_of("a") == {DEVICE_TIER: 2}
    assert index.apply("b", KVEventBatch("b1", 2, (AllBlocksCleared(),)))
    assert index.prefix_blocks([1, 5]) == {"a": 1} and index.blocks_of("b") == {}
    assert (index.num_events_received, index.num_events_applied, index.num_snapshots) == (7, 7, 0)


def test_events_already_applied_are_skipped():
    index = KVIndex()
    index.apply("a", KVEventBatch("a1", 0, (BlockStored(1, None), BlockStored(2, 1))))
    # A batch overlapping what was applied (as after a snapshot): only its new events count.
    assert index.apply("a", KVEventBatch("a1", 1, (BlockStored(2, 1), BlockStored(3, 2))))
    assert index.hashes_of("a") == {DEVICE_TIER: {1, 2, 3}} and index.num_events_applied == 3


def test_a_gap_puts_the_worker_out_of_sync_until_its_snapshot():
    index = KVIndex()
    index.apply("a", KVEventBatch("a1", 0, (BlockStored(1, None), BlockStored(2, 1))))
    # Events 2 and 3 were dropped (the worker's buffer overflowed, or a report was lost).
    assert not index.apply("a", KVEventBatch("a1", 4, (BlockStored(7, None),)))
    assert not index.in_sync("a")
    assert not index.apply("a", KVEventBatch("a1", 5, (BlockStored(8, 7),)))  # waits for the snapshot
    index.resync("a", KVSnapshot("a1", 5, {DEVICE_TIER: (1, 7)}))
    assert index.in_sync("a") and index.hashes_of("a") == {DEVICE_TIER: {1, 7}}
    # Replay from the snapshot's number on: event 4 is in it, 5 on are applied.
    assert index.apply("a", KVEventBatch("a1", 4, (BlockStored(7, None), BlockStored(8, 7))))
    assert index.hashes_of("a") == {DEVICE_TIER: {1, 7, 8}} and index.prefix_blocks([7, 8]) == {"a": 2}
    assert index.num_snapshots == 1 and index.num_events_received == 6 and index.num_events_applied == 3


def test_a_new_incarnation_drops_the_old_entries_and_resyncs_unless_it_starts_afresh():
    index = KVIndex()
    index.apply("a", KVEventBatch("a1", 0, (BlockStored(1, None), BlockStored(2, 1))))
    # Restarted, and its first events were already taken by a report that was lost: out of sync.
    assert not index.apply("a", KVEventBatch("a2", 3, ()))
    assert index.prefix_blocks([1]) == {}
    index.resync("a", KVSnapshot("a2", 3, {DEVICE_TIER: (4,)}))
    assert index.hashes_of("a") == {DEVICE_TIER: {4}}
    # Restarted again, and this batch starts at 0: an empty engine's whole history, no snapshot needed.
    assert index.apply("a", KVEventBatch("a3", 0, (BlockStored(5, None),)))
    assert index.hashes_of("a") == {DEVICE_TIER: {5}} and index.num_snapshots == 1


def test_a_removed_worker_takes_its_entries_out_at_once():
    index = KVIndex()
    index.apply("a", KVEventBatch("a1", 0, (BlockStored(1, None), BlockStored(2, 1))))
    index.apply("b", KVEventBatch("b1", 0, (BlockStored(1, None),)))
    index.remove_worker("a")
    assert index.prefix_blocks([1, 2]) == {"b": 1} and len(index) == 1 and index.blocks_of("a") == {}
    index.remove_worker("a")  # twice: nothing left to remove
    index.remove_worker("b")
    assert len(index) == 0


def test_the_host_and_disk_tiers_events_reach_the_index(tmp_path):
    """A worker's tiers (a tiny pool's) report offloads, spills, deletions and a wipe; the index
    follows them per tier and forgets them all when the worker goes."""
    import torch

    from pdserve.engine.config import KVTierConfig
    from pdserve.engine.kv.events import DISK_TIER, HOST_TIER, KVEventRecorder
    from pdserve.engine.kv.pool import KVLayout, KVPool
    from pdserve.engine.kv.tiers import KVTiers

    layout = KVLayout("tiny", torch.float32, num_layers=1, num_kv_heads=1, head_dim=4, block_size=8)
    tiers = KVTiers(KVTierConfig(host_bytes=2 * layout.bytes_per_block, disk_dir=tmp_path, slot="prefill-0"),
                    KVPool(layout, 4, "cpu"), "digest")
    recorder, index = KVEventRecorder(100), KVIndex()

    def report() -> None:
        recorder.record(tiers.take_events())
        assert index.apply("w", recorder.take())

    tiers.offload([(0, 10), (1, 11), (2, 12)])
    assert tiers.wait_idle(10)
    report()
    assert index.hashes_of("w") == {HOST_TIER: {11, 12}, DISK_TIER: {10}}
    assert index.prefix_blocks([10, 11], DISK_TIER) == {"w": 1}
    tiers.wipe((HOST_TIER,))
    report()
    assert index.blocks_of("w") == {DISK_TIER: 1}
    index.remove_worker("w")
    assert len(index) == 0
    tiers.close()
