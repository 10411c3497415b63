"""KV tiers below the device pool: host memory, then a local disk directory.

A block the prefix cache evicts (its hash no longer finds it in the pool) is copied down
instead of lost: the engine gathers it (on a CUDA host, on a copy stream of its own into
pinned memory, the step's stream waiting for the copy on the GPU, not the host; on the CPU, a
plain copy on the engine's thread, memcpy speed) and a background thread files it: into the
host tier, whose least recently used blocks spill to the disk tier, whose own overflow is
deleted. Neither tier waits for the other, and no step waits for a file to be written.

On a prefix miss in the pool, the scheduler asks `fetch` for the blocks that continue the hit
(host first, then disk, each disk file checked: `engine/kv/disk.py`); the engine copies them
into freshly allocated pool blocks before the step that reads them (`onboard`), and from there
they are ordinary cached blocks. Copies, not moves: a block onboarded stays below too.

Every change of what the tiers hold is a KV event with tier "host" or "disk", collected here
(the background thread makes most of them) and handed to the engine's recorder on its thread
(`take_events`), so the router's index sees the tiers as it sees the pool.

A full disk (a failed write) stops offloading to disk and says so (`KVTierStats.disk_full`)
until the tier is wiped; a request never fails for it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from pdserve.engine.config import KVTierConfig
from pdserve.engine.kv.disk import (
    BlockCodec,
    DiskFiles,
    layout_fingerprint,
    open_folder,
    read_block,
    remove_block,
    wipe_folder,
    write_block,
)
from pdserve.engine.kv.events import DISK_TIER, HOST_TIER, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from pdserve.engine.kv.pool import KVPool

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TierHit:
    """A block found below the pool: which tier, and its KV ([layers, 2, block_size, kv_heads, head_dim], CPU)."""

    tier: str
    block: torch.Tensor


@dataclass(frozen=True, slots=True)
class KVTierStats:
    """Counters since start (gauges where said), for the load report and metrics."""

    hit_tokens: dict[str, int]  # prompt tokens onboarded, by tier
    bytes_offloaded: dict[str, int]  # written into each tier
    bytes_onboarded: dict[str, int]  # copied back into the pool, by the tier they came from
    onboard_seconds: float  # the engine thread's time onboarding (CPU: the copies; CUDA: queueing them)
    num_blocks: dict[str, int]  # gauge: blocks each tier holds
    num_bytes: dict[str, int]  # gauge: bytes each tier holds
    num_rejected: dict[str, int]  # disk files refused, by reason (truncated, foreign, corrupt)
    disk_full: bool  # gauge: a write failed, offloading to disk stopped
    num_in_flight: int  # gauge: offload batches not filed yet


@dataclass(slots=True)
class _Offload:
    """Blocks gathered from the pool, on their way down."""

    block_hashes: list[int]
    blocks: list[torch.Tensor]
    ready: torch.cuda.Event | None  # the gather's completion (CUDA), None: done


@dataclass(slots=True)
class _Counters:
    hit_tokens: dict[str, int] = field(default_factory=lambda: {HOST_TIER: 0, DISK_TIER: 0})
    bytes_offloaded: dict[str, int] = field(default_factory=lambda: {HOST_TIER: 0, DISK_TIER: 0})
    bytes_onboarded: dict[str, int] = field(default_factory=lambda: {HOST_TIER: 0, DISK_TIER: 0})
    onboard_seconds: float = 0.0
    num_rejected: dict[str, int] = field(default_factory=dict)


class KVTiers:
    """One worker's host and disk tiers (either may be off) and the thread that fills them."""

    def __init__(self, config: KVTierConfig, pool: KVPool, model_digest: str) -> None:
        layout = pool.layout
        self.config = config
        self.pool = pool
        self.block_size = layout.block_size
        self.bytes_per_block = layout.bytes_per_block
        self._shape = (layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
        self._device = pool.kv.device
        self._stream = torch.cuda.Stream(self._device) if self._device.type == "cuda" else None
        self._host_max_blocks = config.host_bytes // self.bytes_per_block
        self._host: OrderedDict[int, torch.Tensor] = OrderedDict()  # least recently used first
        self._codec = BlockCodec(layout_fingerprint(layout, model_digest), self._shape, layout.dtype)
        self._disk: DiskFiles | None = None
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._events: list[KVEvent] = []
        self._counters = _Counters()
        self._disk_full = False
        self._num_in_flight = 0
        if config.disk_dir is not None:
            folder = config.disk_dir / config.slot
            open_folder(folder, config.disk_persist)
            self._disk = DiskFiles(folder, config.disk_bytes)
            self._events += [BlockStored(h, None, DISK_TIER) for h in self._disk.scan()]
        self._jobs: queue.Queue[_Offload | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kv-offload", daemon=True)
        self._thread.start()

    # The engine's thread ------------------------------------------------------

    def offload(self, evicted: list[tuple[int, int]], wait: bool = False) -> None:
        """Copy the pool's evicted blocks `(block id, hash)` down. Call after the allocation that
        evicted them and before anything writes them: the copy is queued ahead of every later
        step (`wait`: and complete on return, for a writer outside the engine's stream, a KV
        transfer into reserved blocks)."""
        with self._lock:
            todo = [(b, h) for b, h in evicted if not self._holds(h)]
            if todo:
                self._num_in_flight += 1
        if not todo:
            return
        blocks, ready = self._gather([b for b, _ in todo])
        if wait and ready is not None:
            ready.synchronize()
        self._jobs.put(_Offload([h for _, h in todo], blocks, ready))

    def fetch(self, block_hashes: list[int]) -> list[TierHit]:
        """The blocks found below the pool for the longest leading run of `block_hashes`
        (each disk block checked; a bad one ends the run and is deleted)."""
        hits: list[TierHit] = []
        for h in block_hashes:
            with self._lock:
                block = self._host.get(h)
                if block is not None:
                    self._host.move_to_end(h)
                on_disk = block is None and self._disk is not None and h in self._disk
            if block is not None:
                hits.append(TierHit(HOST_TIER, block))
                continue
            block = self._read_disk(h) if on_disk else None
            if block is None:
                break
            hits.append(TierHit(DISK_TIER, block))
        return hits

    def onboard(self, targets: list[tuple[int, TierHit]]) -> None:
        """Copy fetched blocks into pool blocks `(block id, hit)`, ahead of every later step."""
        if not targets:
            return
        start = time.perf_counter()
        if self._stream is None:
            for block_id, hit in targets:
                self.pool.kv[:, :, block_id].copy_(hit.block)
        else:
            main = torch.cuda.current_stream(self._device)
            self._stream.wait_stream(main)  # after the offloads queued before it (a target may be one)
            with torch.cuda.stream(self._stream):
                for block_id, hit in targets:
                    self.pool.kv[:, :, block_id].copy_(hit.block, non_blocking=True)
            main.wait_stream(self._stream)
        with self._lock:
            c = self._counters
            c.onboard_seconds += time.perf_counter() - start
            for _, hit in targets:
                c.hit_tokens[hit.tier] += self.block_size
                c.bytes_onboarded[hit.tier] += self.bytes_per_block

    def take_events(self) -> list[KVEvent]:
        """The tiers' events since the last call (for the engine's recorder)."""
        with self._lock:
            events, self._events = self._events, []
        return events

    def snapshot(self) -> tuple[list[KVEvent], dict[str, tuple[int, ...]]]:
        """The events not taken yet and, as of them, every hash each tier holds (one moment)."""
        with self._lock:
            events, self._events = self._events, []
            hashes = {HOST_TIER: tuple(self._host)}
            if self._disk is not None:
                hashes[DISK_TIER] = self._disk.hashes()
        return events, hashes

    def stats(self) -> KVTierStats:
        with self._lock:
            c = self._counters
            num_blocks = {HOST_TIER: len(self._host), DISK_TIER: len(self._disk) if self._disk else 0}
            num_bytes = {HOST_TIER: len(self._host) * self.bytes_per_block,
                         DISK_TIER: self._disk.num_bytes if self._disk else 0}
            return KVTierStats(dict(c.hit_tokens), dict(c.bytes_offloaded), dict(c.bytes_onboarded),
                               c.onboard_seconds, num_blocks, num_bytes, dict(c.num_rejected),
                               self._disk_full, self._num_in_flight)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every offload queued so far is filed; whether it was within `timeout_s`."""
        with self._idle:
            return self._idle.wait_for(lambda: self._num_in_flight == 0, timeout_s)

    def wipe(self, tiers: tuple[str, ...] = (HOST_TIER, DISK_TIER), timeout_s: float = 10.0) -> None:
        """Drop every block of `tiers` (disk: the slot's files too); offloading to disk resumes."""
        self.wait_idle(timeout_s)
        with self._lock:
            if HOST_TIER in tiers:
                self._host.clear()
                self._events.append(AllBlocksCleared(HOST_TIER))
            if DISK_TIER in tiers and self._disk is not None:
                self._disk.clear()
                wipe_folder(self._disk.folder)
                open_folder(self._disk.folder, persist=True)
                self._disk_full = False
                self._events.append(AllBlocksCleared(DISK_TIER))

    def close(self) -> None:
        """Stop the offload thread once what is queued is filed."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()

    def _holds(self, block_hash: int) -> bool:
        """Already below (nothing to copy): in the host tier, or on disk with no host tier."""
        if block_hash in self._host:
            self._host.move_to_end(block_hash)
            return True
        return self._host_max_blocks == 0 and self._disk is not None and block_hash in self._disk

    def _gather(self, block_ids: list[int]) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
        kv = self.pool.kv
        if self._stream is None:
            return [kv[:, :, b].clone(memory_format=torch.contiguous_format) for b in block_ids], None
        main = torch.cuda.current_stream(self._device)
        self._stream.wait_stream(main)  # the blocks' last writes first
        with torch.cuda.stream(self._stream):
            blocks = []
            for b in block_ids:
                dst = torch.empty(self._shape, dtype=kv.dtype, pin_memory=True)
                dst.copy_(kv[:, :, b], non_blocking=True)
                blocks.append(dst)
            ready = torch.cuda.Event()
            ready.record(self._stream)
        main.wait_stream(self._stream)  # whoever reuses the blocks writes them after the copy
        return blocks, ready

    # The offload thread -------------------------------------------------------

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._file(job)
            except Exception:  # a tier's failure costs its blocks, never the engine
                logger.exception("offloading %d KV blocks failed", len(job.block_hashes))
            finally:
                with self._idle:
                    self._num_in_flight -= 1
                    self._idle.notify_all()

    def _file(self, job: _Offload) -> None:
        if job.ready is not None:
            job.ready.synchronize()
        for h, block in zip(job.block_hashes, job.blocks):
            spilled: list[tuple[int, torch.Tensor]] = []
            with self._lock:
                if self._host_max_blocks == 0:
                    spilled.append((h, block))
                elif h not in self._host:
                    self._host[h] = block
                    self._counters.bytes_offloaded[HOST_TIER] += self.bytes_per_block
                    self._events.append(BlockStored(h, None, HOST_TIER))
                    while len(self._host) > self._host_max_blocks:
                        old = self._host.popitem(last=False)
                        self._events.append(BlockRemoved(old[0], HOST_TIER))
                        spilled.append(old)
            for old_hash, old_block in spilled:
                self._write_disk(old_hash, old_block)

    def _write_disk(self, block_hash: int, block: torch.Tensor) -> None:
        disk = self._disk
        with self._lock:
            if disk is None or self._disk_full:
                return
            if block_hash in disk:
                disk.touch(block_hash)
                return
        header, payload = self._codec.encode(block_hash, block)
        try:
            write_block(disk.folder, block_hash, header, payload)
        except OSError as e:
            logger.warning("KV disk tier %s: writing a block failed (%s): offloading to disk stopped", disk.folder, e)
            with self._lock:
                self._disk_full = True
            return
        with self._lock:
            evicted = disk.add(block_hash, len(header) + len(payload))
            self._counters.bytes_offloaded[DISK_TIER] += len(header) + len(payload)
            self._events.append(BlockStored(block_hash, None, DISK_TIER))
            self._events += [BlockRemoved(old, DISK_TIER) for old in evicted]
        for old in evicted:
            remove_block(disk.folder, old)

    def _read_disk(self, block_hash: int) -> torch.Tensor | None:
        """A disk block, checked; None (and the file gone from the tier) if it is missing or bad."""
        disk = self._disk
        assert disk is not None
        data = read_block(disk.folder, block_hash)
        decoded = self._codec.decode(block_hash, data) if data is not None else "missing"
        if isinstance(decoded, torch.Tensor):
            with self._lock:
                if block_hash in disk:
                    disk.touch(block_hash)
            return decoded
        logger.warning("KV disk tier %s: block %016x is %s: recomputing it", disk.folder, block_hash, decoded)
        with self._lock:
            if decoded != "missing":
                self._counters.num_rejected[decoded] = self._counters.num_rejected.get(decoded, 0) + 1
            if disk.discard(block_hash):
                self._events.append(BlockRemoved(block_hash, DISK_TIER))
        remove_block(disk.folder, block_hash)
        return None
