"""The host and disk tiers on a tiny pool (no model): offload, fetch, onboard, events, the disk
files' checks and permissions, a full disk, a restart, wiping."""

from __future__ import annotations

import errno
import os
import stat

import pytest
import torch

from pdserve.engine.config import KVTierConfig
from pdserve.engine.kv import tiers as kv_tiers
from pdserve.engine.kv.disk import block_path
from pdserve.engine.kv.events import DISK_TIER, HOST_TIER, AllBlocksCleared, BlockRemoved, BlockStored
from pdserve.engine.kv.pool import KVLayout, KVPool
from pdserve.engine.kv.tiers import KVTiers

LAYOUT = KVLayout("tiny", torch.float32, num_layers=2, num_kv_heads=1, head_dim=4, block_size=8)
BLOCK_BYTES = LAYOUT.bytes_per_block


def make_pool(num_blocks: int = 8) -> KVPool:
    pool = KVPool(LAYOUT, num_blocks, "cpu")
    pool.kv.copy_(torch.randn_like(pool.kv))
    return pool


def make_tiers(pool: KVPool, tmp_path, host_blocks: int = 4, disk: bool = True, digest: str = "model-a",
               **kwargs) -> KVTiers:
    config = KVTierConfig(host_bytes=host_blocks * BLOCK_BYTES, disk_dir=tmp_path if disk else None,
                          slot="prefill-0", **kwargs)
    return KVTiers(config, pool, digest)


def offload(tiers: KVTiers, evicted: list[tuple[int, int]]) -> None:
    tiers.offload(evicted)
    assert tiers.wait_idle(10)


def test_evicted_blocks_go_to_host_then_spill_to_disk_and_come_back(tmp_path):
    pool = make_pool()
    tiers = make_tiers(pool, tmp_path, host_blocks=2)
    want = {h: pool.kv[:, :, b].clone() for b, h in [(0, 100), (1, 101), (2, 102)]}
    offload(tiers, [(0, 100), (1, 101), (2, 102)])
    stats = tiers.stats()
    assert stats.num_blocks == {HOST_TIER: 2, DISK_TIER: 1} and stats.num_in_flight == 0
    events = tiers.take_events()
    assert BlockStored(100, None, DISK_TIER) in events and BlockRemoved(100, HOST_TIER) in events
    hits = tiers.fetch([100, 101, 102, 999])
    assert [h.tier for h in hits] == [DISK_TIER, HOST_TIER, HOST_TIER]
    pool.kv.zero_()
    tiers.onboard([(5, hits[0]), (6, hits[1]), (7, hits[2])])
    for block_id, h in [(5, 100), (6, 101), (7, 102)]:
        assert torch.equal(pool.kv[:, :, block_id], want[h])
    stats = tiers.stats()
    assert stats.hit_tokens == {HOST_TIER: 16, DISK_TIER: 8}
    assert stats.bytes_onboarded[DISK_TIER] == BLOCK_BYTES
    tiers.close()


def test_disk_files_are_private_and_survive_a_restart(tmp_path):
    pool = make_pool()
    tiers = make_tiers(pool, tmp_path, host_blocks=0)
    offload(tiers, [(3, 7)])
    tiers.close()
    folder = tmp_path / "prefill-0"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE(block_path(folder, 7).stat().st_mode) == 0o600
    again = make_tiers(pool, tmp_path, host_blocks=0)
    assert again.take_events() == [BlockStored(7, None, DISK_TIER)]  # the index learns it at start
    [hit] = again.fetch([7])
    assert torch.equal(hit.block, pool.kv[:, :, 3])
    again.close()
    wiped = make_tiers(pool, tmp_path, host_blocks=0, disk_persist=False)
    assert wiped.fetch([7]) == [] and not any(folder.iterdir())
    wiped.close()


@pytest.mark.parametrize("damage", ["truncated", "corrupt", "foreign"])
def test_a_bad_disk_block_is_refused_deleted_and_counted(tmp_path, damage):
    pool = make_pool()
    tiers = make_tiers(pool, tmp_path, host_blocks=0)
    offload(tiers, [(0, 1), (1, 2)])
    tiers.close()
    path = block_path(tmp_path / "prefill-0", 2)
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[:-5])
    elif damage == "corrupt":
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    again = make_tiers(pool, tmp_path, host_blocks=0, digest="model-b" if damage == "foreign" else "model-a")
    again.take_events()
    hits = again.fetch([1, 2])
    assert len(hits) == (0 if damage == "foreign" else 1)  # a foreign model's blocks are all refused
    assert again.stats().num_rejected == {damage: 1}
    assert BlockRemoved(1 if damage == "foreign" else 2, DISK_TIER) in again.take_events()
    assert not path.exists() or damage == "foreign"
    again.close()


def test_a_full_disk_stops_offloading_and_says_so(tmp_path, monkeypatch):
    pool = make_pool()
    tiers = make_tiers(pool, tmp_path, host_blocks=0)

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(kv_tiers, "write_block", full)
    offload(tiers, [(0, 1)])
    assert tiers.stats().disk_full and tiers.stats().num_blocks[DISK_TIER] == 0
    monkeypatch.undo()
    offload(tiers, [(1, 2)])  # stopped: nothing written
    assert tiers.stats().num_blocks[DISK_TIER] == 0
    tiers.wipe()
    assert not tiers.stats().disk_full
    assert AllBlocksCleared(DISK_TIER) in tiers.take_events()
    offload(tiers, [(1, 2)])
    assert tiers.stats().num_blocks[DISK_TIER] == 1
    tiers.close()


def test_the_disk_tier_is_bounded_in_bytes(tmp_path):
    pool = make_pool()
    header_and_block = BLOCK_BYTES + 72
    tiers = make_tiers(pool, tmp_path, host_blocks=0, disk_bytes=3 * header_and_block)
    offload(tiers, [(b, 10 + b) for b in range(5)])
    assert tiers.stats().num_blocks[DISK_TIER] == 3
    assert len(list((tmp_path / "prefill-0").iterdir())) == 3
    assert [h.tier for h in tiers.fetch([12, 13, 14])] == [DISK_TIER] * 3
    assert tiers.fetch([10]) == []
    tiers.close()


@pytest.mark.gpu
def test_on_cuda_the_copies_run_on_their_own_stream_and_the_pool_waits_for_them(tmp_path):
    """A pool on the GPU: the gather into pinned memory and the onboarding copy are ordered
    before the pool's later writes by the streams alone (no host wait in between)."""
    pool = KVPool(LAYOUT, 8, "cuda")
    pool.kv.copy_(torch.randn_like(pool.kv))
    want = pool.kv[:, :, 1].cpu()
    tiers = make_tiers(pool, tmp_path, host_blocks=1)
    tiers.offload([(1, 5)])
    pool.kv[:, :, 1].zero_()  # the block's new owner writes it: after the copy, on the GPU
    assert tiers.wait_idle(10)
    [hit] = tiers.fetch([5])
    assert hit.block.is_pinned() and torch.equal(hit.block, want)
    tiers.onboard([(6, hit)])
    pool.kv[:, :, 7].copy_(pool.kv[:, :, 6])  # the step that reads it, on the pool's stream
    assert torch.equal(pool.kv[:, :, 7].cpu(), want)
    tiers.close()
