"""The router's global index of the cluster's KV caches: block hash -> {(worker, tier)}.

Fed only by what the workers report (`engine/kv/events.py`), never by what the router sent
where: it sees evictions, preemptions, restarts and requests other routers placed. Each
worker's events are applied in their numbered order; a batch that starts past the next
expected number (events dropped on the worker's overflow, or a lost report) or comes from
a new incarnation that does not start at 0 puts the worker out of sync: `apply` says so, the
caller fetches the worker's snapshot and `resync` replaces its entries and replays from the
snapshot's number on (events before it, still in flight, are skipped). A worker that dies or
leaves is taken out at once (`remove_worker`).

One writer (the coordinator's event loop), no locks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pdserve.engine.kv.events import (
    DEVICE_TIER,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    KVSnapshot,
)


@dataclass(slots=True)
class _WorkerLog:
    """Where one worker's event stream stands, and what it holds."""

    incarnation: str
    next_seq: int = 0
    in_sync: bool = True  # False: waiting for a snapshot; its batches are not applied meanwhile
    blocks: dict[str, set[int]] = field(default_factory=dict)  # tier -> hashes


class KVIndex:
    def __init__(self) -> None:
        self._holders: dict[int, set[tuple[str, str]]] = {}  # block hash -> {(worker id, tier)}
        self._workers: dict[str, _WorkerLog] = {}
        self.num_events_received = 0
        self.num_events_applied = 0
        self.num_snapshots = 0  # resyncs from a worker's snapshot

    def __len__(self) -> int:
        """Entries: one per block a worker holds in a tier."""
        return sum(len(holders) for holders in self._holders.values())

    # Keeping it --------------------------------------------------------------

    def apply(self, worker_id: str, batch: KVEventBatch) -> bool:
        """Apply a worker's batch; False if the worker is out of sync (wants `resync`)."""
        log = self._workers.get(worker_id)
        if log is None or log.incarnation != batch.incarnation:
            # A new worker, or one restarted: nothing it held before is there any more.
            self.remove_worker(worker_id)
            log = self._workers[worker_id] = _WorkerLog(batch.incarnation)
        self.num_events_received += len(batch.events)
        if not log.in_sync or batch.first_seq > log.next_seq:
            log.in_sync = False
            return False
        for event in batch.events[log.next_seq - batch.first_seq:]:
            self._apply_event(worker_id, log, event)
            self.num_events_applied += 1
        log.next_seq = max(log.next_seq, batch.next_seq)
        return True

    def resync(self, worker_id: str, snapshot: KVSnapshot) -> None:
        """Replace a worker's entries by its snapshot; its events from `snapshot.next_seq` on follow."""
        self.remove_worker(worker_id)
        log = self._workers[worker_id] = _WorkerLog(snapshot.incarnation, snapshot.next_seq)
        for tier, hashes in snapshot.block_hashes.items():
            for h in hashes:
                self._add(worker_id, log, tier, h)
        self.num_snapshots += 1

    def remove_worker(self, worker_id: str) -> None:
        """Take every entry of a worker out (it died or left)."""
        log = self._workers.pop(worker_id, None)
        if log is not None:
            for tier in list(log.blocks):
                self._clear_tier(worker_id, log, tier)

    def _apply_event(self, worker_id: str, log: _WorkerLog, event: KVEvent) -> None:
        if isinstance(event, BlockStored):
            self._add(worker_id, log, event.tier, event.block_hash)
        elif isinstance(event, BlockRemoved):
            self._discard(worker_id, log, event.tier, event.block_hash)
        elif isinstance(event, AllBlocksCleared):
            self._clear_tier(worker_id, log, event.tier)

    def _add(self, worker_id: str, log: _WorkerLog, tier: str, block_hash: int) -> None:
        log.blocks.setdefault(tier, set()).add(block_hash)
        self._holders.setdefault(block_hash, set()).add((worker_id, tier))

    def _discard(self, worker_id: str, log: _WorkerLog, tier: str, block_hash: int) -> None:
        log.blocks.get(tier, set()).discard(block_hash)
        holders = self._holders.get(block_hash)
        if holders is not None:
            holders.discard((worker_id, tier))
            if not holders:
                del self._holders[block_hash]

    def _clear_tier(self, worker_id: str, log: _WorkerLog, tier: str) -> None:
        for h in log.blocks.pop(tier, set()):
            holders = self._holders[h]
            holders.discard((worker_id, tier))
            if not holders:
                del self._holders[h]

    # Reading it --------------------------------------------------------------

    def prefix_blocks(self, block_hashes: Sequence[int], tier: str = DEVICE_TIER) -> dict[str, int]:
        """Per worker, how many leading blocks of a prompt it holds in `tier` (workers holding
        none are left out). One walk down the prompt, stopping where no worker is left."""
        matched: dict[str, int] = {}
        alive: set[str] | None = None
        for i, h in enumerate(block_hashes):
            here = {w for w, t in self._holders.get(h, ()) if t == tier}
            alive = here if alive is None else alive & here
            if not alive:
                break
            for w in alive:
                matched[w] = i + 1
        return matched

    def prefix_credit(self, block_hashes: Sequence[int], credits: Mapping[str, float]) -> dict[str, float]:
        """Per worker, the leading blocks of a prompt it holds in any tier of `credits`, each
        counted at the best credit of the tiers it holds it in (a block in host memory or on
        disk saves less than one in the pool: it is copied back first). Workers holding none
        are left out."""
        credited: dict[str, float] = {}
        alive: set[str] | None = None
        for h in block_hashes:
            best: dict[str, float] = {}
            for w, tier in self._holders.get(h, ()):
                credit = credits.get(tier, 0.0)
                if credit > 0 and (alive is None or w in alive):
                    best[w] = max(best.get(w, 0.0), credit)
            if not best:
                break
            alive = set(best)
            for w, credit in best.items():
                credited[w] = credited.get(w, 0.0) + credit
        return credited

    def blocks_of(self, worker_id: str) -> dict[str, int]:
        """A worker's cached blocks, per tier."""
        log = self._workers.get(worker_id)
        return {} if log is None else {tier: len(hashes) for tier, hashes in log.blocks.items()}

    def hashes_of(self, worker_id: str) -> dict[str, set[int]]:
        """A worker's cached block hashes, per tier (a copy)."""
        log = self._workers.get(worker_id)
        return {} if log is None else {tier: set(hashes) for tier, hashes in log.blocks.items()}

    def in_sync(self, worker_id: str) -> bool:
        log = self._workers.get(worker_id)
        return log is not None and log.in_sync
