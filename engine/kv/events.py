"""What an engine's prefix cache tells the router: blocks stored, removed, cleared.

The router keeps one index of which worker holds which block (`cluster/serving/kv_index.py`); it is
fed by these events, never by guesses. Each event carries the tier its block is in
("device", the KV pool; "host" and "disk", the tiers below it, `engine/kv/tiers.py`) and a
per-engine sequence number; a batch names the engine's incarnation (fresh at every start).
A receiver that sees a gap in the numbers, or a new incarnation, has missed something and
asks for a `KVSnapshot` instead of guessing.

The recorder is written on the engine's thread only (the block manager's calls) and drained
there too (the worker's load report), so it needs no lock. Its buffer is bounded: on
overflow the oldest events are dropped, their numbers stay spent, and the gap this leaves
makes the router resynchronize from a snapshot.

Light on purpose (no torch): the cluster imports it, and Ray ships its classes.
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

DEVICE_TIER = "device"  # the engine's KV pool
HOST_TIER = "host"  # host memory below it (engine/kv/tiers.py)
DISK_TIER = "disk"  # a local disk directory below that


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A full block became a reusable prefix-cache block (found by its chained hash)."""

    block_hash: int
    parent_hash: int | None  # the block before it in its prompt (None: the first block)
    tier: str = DEVICE_TIER


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """A cached block was evicted: its hash no longer finds it."""

    block_hash: int
    tier: str = DEVICE_TIER


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every cached block of the tier is gone."""

    tier: str = DEVICE_TIER


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """The events since the last batch. `events[i]` has sequence number `first_seq + i`; a batch
    is sent even when empty, so that its `first_seq` shows events dropped on overflow."""

    incarnation: str
    first_seq: int
    events: tuple[KVEvent, ...] = ()

    @property
    def next_seq(self) -> int:
        """The number of the first event after this batch."""
        return self.first_seq + len(self.events)


@dataclass(frozen=True, slots=True)
class KVSnapshot:
    """Every block an engine holds in its cache, by tier, as of the events numbered below
    `next_seq`: an index that takes it applies events from `next_seq` on."""

    incarnation: str
    next_seq: int
    block_hashes: dict[str, tuple[int, ...]]


class KVEventRecorder:
    """An engine's outgoing events: numbered as recorded, buffered up to `max_pending`."""

    def __init__(self, max_pending: int) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.incarnation = uuid.uuid4().hex
        self.max_pending = max_pending
        self.next_seq = 0
        self.num_dropped = 0
        self._pending: deque[KVEvent] = deque()

    def record(self, events: Iterable[KVEvent]) -> None:
        for event in events:
            if len(self._pending) == self.max_pending:
                self._pending.popleft()
                self.num_dropped += 1
            self._pending.append(event)
            self.next_seq += 1

    def take(self) -> KVEventBatch:
        """The buffered events (numbered), and an empty buffer."""
        events = tuple(self._pending)
        self._pending.clear()
        return KVEventBatch(self.incarnation, self.next_seq - len(events), events)

    def snapshot(self, block_hashes: dict[str, tuple[int, ...]]) -> KVSnapshot:
        """`block_hashes` (what the cache holds now) as of every event recorded so far."""
        return KVSnapshot(self.incarnation, self.next_seq, block_hashes)


@dataclass(slots=True)
class _Cursor:
    first_seq: int  # the number of the first event in `events`
    events: deque[KVEvent]
    last_read: float


class EventFanout:
    """One engine's events for several readers (the frontends and the control plane, each
    with a KV index of its own): each reader takes every event once, through its own cursor.
    A reader's buffer is bounded as the recorder's is (overflow drops its oldest events, the
    gap makes that reader resync from a snapshot); a reader silent for `forget_after_s` is
    forgotten (a frontend that died), except the unnamed one ("": a single server)."""

    def __init__(self, max_pending: int, forget_after_s: float) -> None:
        self.max_pending = max_pending
        self.forget_after_s = forget_after_s
        self._cursors: dict[str, _Cursor] = {}

    @property
    def readers(self) -> tuple[str, ...]:
        return tuple(self._cursors)

    def take(self, reader: str, fresh: KVEventBatch, now: float) -> KVEventBatch:
        """`fresh` (the recorder's events since anyone's last take) added to every reader's
        buffer; `reader`'s whole buffer returned and emptied."""
        for cursor in self._cursors.values():
            if fresh.first_seq != cursor.first_seq + len(cursor.events):  # the recorder dropped some:
                cursor.events.clear()  # the reader sees the gap, and resyncs
                cursor.first_seq = fresh.first_seq
            cursor.events.extend(fresh.events)
            dropped = len(cursor.events) - self.max_pending
            for _ in range(max(dropped, 0)):
                cursor.events.popleft()
                cursor.first_seq += 1
        cursor = self._cursors.get(reader)
        if cursor is None:  # a new reader starts with this batch (a gap before it: it resyncs)
            cursor = self._cursors[reader] = _Cursor(fresh.first_seq, deque(fresh.events[-self.max_pending:]), now)
            cursor.first_seq = fresh.next_seq - len(cursor.events)
        batch = KVEventBatch(fresh.incarnation, cursor.first_seq, tuple(cursor.events))
        cursor.first_seq, cursor.last_read = batch.next_seq, now
        cursor.events.clear()
        for name in [r for r, c in self._cursors.items() if r and now - c.last_read > self.forget_after_s]:
            del self._cursors[name]
        return batch

    def forget(self, reader: str) -> None:
        self._cursors.pop(reader, None)

