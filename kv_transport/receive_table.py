"""Receiver-side bookkeeping shared by the UCX and loopback receivers.

Data and `expect()` may arrive in either order: a request's KV can land before the
decode worker has registered its blocks. Whatever the order, every expect resolves
exactly once, every landed payload is acknowledged exactly once, and nothing waits
longer than the transfer timeout past its sender's last sign of life: a sender that is
still computing a request's KV says so (`touch`, the "alive" frames of the sender's
`KeepAlive`), so a prefill that takes minutes does not time its decode side out.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pdserve.kv_transport.api import (
    TransferCancelled,
    TransferError,
    TransferRejected,
    TransferResult,
    TransferTimeout,
)
from pdserve.kv_transport.shards import PoolShards
from pdserve.kv_transport.staging import (
    check_block_ids,
    end_unwritten,
    mark_end,
    staging_num_blocks,
    staging_tail,
)

# Tells the sender how its payload ended: None when it landed, else the error.
Ack = Callable[[TransferError | None], None]
# Answers a sender that asks to write straight into the pool: the block ids to write, or why not.
Grant = Callable[[torch.Tensor | TransferError], None]


@dataclass(slots=True)
class _Writer:
    """A sender granted direct writes into a request's blocks, until it says `written`."""

    abort: Callable[[], None]  # breaks the writer's connection, which fails the request
    cancel: TransferError | None = None  # the receiver cancelled meanwhile: fail on `written`


@dataclass(slots=True)
class _Expected:
    ids: torch.Tensor
    future: asyncio.Future[TransferResult]
    started: float
    timer: asyncio.TimerHandle
    writer: _Writer | None = None


@dataclass(slots=True)
class _EarlyWrite:
    """A request to write that arrived before its expect()."""

    grant: Grant
    abort: Callable[[], None]
    timer: asyncio.TimerHandle


@dataclass(slots=True)
class _Early:
    """A payload that landed before its expect()."""

    staging: torch.Tensor
    transport: str
    ack: Ack
    timer: asyncio.TimerHandle


class ReceiveTable:
    """Matches landed payloads with expected requests and scatters them into the pool.

    Direct writes (a sender copying into the pool itself) take two steps: `grant()`
    hands the sender the block ids, `written()` lands the request. Between the two the
    blocks are the sender's: a cancel or timeout waits for `written` or for the writer's
    connection to break, so blocks are never freed while a copy may still reach them.
    """

    def __init__(self, kv: torch.Tensor | PoolShards, timeout_s: float) -> None:
        self._pool = PoolShards.of(kv)  # the pool, or a tensor-parallel worker's ranks' pools
        self._timeout_s = timeout_s
        self._bytes_per_block = self._pool.bytes_per_block
        self._expected: dict[str, _Expected] = {}
        self._early: dict[str, _Early] = {}
        self._early_writes: dict[str, _EarlyWrite] = {}
        # Recently failed ids, so that late data is refused at once instead of parked.
        self._tombstones: dict[str, tuple[TransferError, asyncio.TimerHandle]] = {}
        self._stream: torch.cuda.Stream | None = None  # payloads' buffers and scatters (GPU pools)

    @property
    def num_pending(self) -> int:
        """Expects not yet resolved plus payloads waiting for their expect (0 when idle)."""
        return len(self._expected) + len(self._early) + len(self._early_writes)

    def expect(self, request_id: str, block_ids: Sequence[int]) -> asyncio.Future[TransferResult]:
        if request_id in self._expected:
            raise ValueError(f"request {request_id!r} is already expected")
        ids = check_block_ids(block_ids, self._pool.num_blocks)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[TransferResult] = loop.create_future()
        timer = loop.call_later(self._timeout_s, self._expire, request_id)
        self._expected[request_id] = _Expected(ids, future, time.perf_counter(), timer)
        self._clear_tombstone(request_id)
        # A caller that cancels the future (or the task awaiting it) cancels the request.
        future.add_done_callback(lambda f: f.cancelled() and self.cancel(request_id))
        early = self._early.pop(request_id, None)
        if early is not None:
            early.timer.cancel()
            self._land(request_id, early.staging, early.transport, early.ack)
        early_write = self._early_writes.pop(request_id, None)
        if early_write is not None:
            early_write.timer.cancel()
            self.grant(request_id, early_write.grant, early_write.abort)
        return future

    def touch(self, request_ids: Sequence[str]) -> None:
        """The sender of `request_ids` is still working on them (computing their KV): their
        waits start over. Unknown ids are ignored (their expect() may come later)."""
        loop = asyncio.get_running_loop()
        for request_id in request_ids:
            entry = self._expected.get(request_id)
            if entry is not None:
                entry.timer.cancel()
                entry.timer = loop.call_later(self._timeout_s, self._expire, request_id)
            early_write = self._early_writes.get(request_id)
            if early_write is not None:
                early_write.timer.cancel()
                early_write.timer = loop.call_later(self._timeout_s, self._expire_early, request_id)

    def cancel(self, request_id: str, reason: str = "cancelled by the receiver", writer_done: bool = False) -> None:
        """Fail `request_id` now, or, while a granted writer may be copying, once it is done.

        `writer_done`: the cancel comes from the writer itself, which has no copy in flight.
        """
        error = TransferCancelled(f"request {request_id!r}: {reason}")
        if writer_done:
            self._stop_writer(request_id)
        early = self._early.pop(request_id, None)
        if early is not None:
            early.timer.cancel()
            early.ack(error)
        early_write = self._early_writes.pop(request_id, None)
        if early_write is not None:
            early_write.timer.cancel()
            early_write.grant(error)
        entry = self._expected.get(request_id)
        if entry is not None and entry.writer is not None:
            entry.writer.cancel = error  # a copy may be in flight: resolve on written / link loss
            return
        self._fail(request_id, error)

    def grant(self, request_id: str, grant: Grant, abort: Callable[[], None]) -> None:
        """A sender asks to copy the blocks of `request_id` into the pool itself.

        `grant` gets the block ids at once if the request is expected, later if its
        expect() comes within the timeout, or the error. The writer checks the count (it
        may ask before its KV exists). `abort` breaks the writer's connection; it is
        called if the writer never reports `written` or `cancel` in time.
        """
        tomb = self._tombstones.get(request_id)
        entry = self._expected.get(request_id)
        if tomb is not None:
            grant(tomb[0])
        elif entry is not None:
            if entry.writer is not None:
                grant(TransferRejected(f"request {request_id!r} sent twice"))
            else:
                entry.writer = _Writer(abort)
                grant(entry.ids)
        elif request_id in self._early or request_id in self._early_writes:
            grant(TransferRejected(f"request {request_id!r} sent twice"))
        else:
            timer = asyncio.get_running_loop().call_later(self._timeout_s, self._expire_early, request_id)
            self._early_writes[request_id] = _EarlyWrite(grant, abort, timer)

    def written(self, request_id: str, transport: str, ready: torch.cuda.Event | None = None) -> None:
        """The writer granted `request_id` has copied it (or queued the copy: then `ready`
        completes once it is done; see TransferResult.ready)."""
        entry = self._expected.get(request_id)
        if entry is None or entry.writer is None:
            return  # already failed (its writer's link broke first); nothing holds the blocks
        cancelled = entry.writer.cancel
        entry.writer = None
        if cancelled is not None:
            self._fail(request_id, cancelled)
            return
        del self._expected[request_id]
        entry.timer.cancel()
        if not entry.future.done():
            entry.future.set_result(self._result(request_id, entry, transport, None, direct=True, ready=ready))

    def failed(self, request_id: str, error: TransferError) -> None:
        """The data of `request_id` will never land (its connection broke)."""
        self._fail(request_id, error)

    def landed(self, request_id: str, staging: torch.Tensor, transport: str, ack: Ack) -> None:
        """A payload for `request_id` is in `staging` (from `gather_blocks` or `staging()`)."""
        tomb = self._tombstones.get(request_id)
        if tomb is not None:
            ack(tomb[0])
        elif request_id in self._expected and self._expected[request_id].writer is None:
            self._land(request_id, staging, transport, ack)
        elif request_id in self._expected or request_id in self._early or request_id in self._early_writes:
            ack(TransferRejected(f"request {request_id!r} sent twice"))
        else:
            timer = asyncio.get_running_loop().call_later(self._timeout_s, self._expire_early, request_id)
            self._early[request_id] = _Early(staging, transport, ack, timer)

    def close(self) -> None:
        for request_id in list(self._expected):
            abort = self._stop_writer(request_id)
            self.cancel(request_id, "receiver closed")
            if abort is not None:
                abort()
        for request_id in [*self._early, *self._early_writes]:
            self.cancel(request_id, "receiver closed")
        for request_id in list(self._tombstones):
            self._clear_tombstone(request_id)

    def _land(self, request_id: str, staging: torch.Tensor, transport: str, ack: Ack) -> None:
        entry = self._expected[request_id]
        num_blocks = staging_num_blocks(staging)
        if num_blocks != entry.ids.numel():
            error = TransferRejected(
                f"request {request_id!r}: sender sent {num_blocks} blocks, receiver expects {entry.ids.numel()}"
            )
            ack(error)
            self._fail(request_id, error)
            return
        ready = self._scatter(entry.ids, staging)
        del self._expected[request_id]
        entry.timer.cancel()
        ack(None)
        if not entry.future.done():
            entry.future.set_result(self._result(request_id, entry, transport, None, ready=ready))

    def _scatter(self, ids: torch.Tensor, staging: torch.Tensor) -> torch.cuda.Event | None:
        """Write a payload into its blocks. On a GPU on a stream of the table's own, so that
        neither the event loop nor the copy waits for the engine's steps: the result's
        `ready` completes with it (see TransferResult.ready). On the CPU done on return."""
        if not self._pool.is_cuda:
            self._pool.scatter(ids, staging)
            return None
        stream = self._gpu_stream()
        with torch.cuda.stream(stream):
            self._pool.scatter(ids, staging)
            staging.record_stream(stream)  # a loopback payload comes from the caller's stream
            ready = torch.cuda.Event()
            ready.record(stream)
        return ready

    async def staging(self, num_blocks: int) -> tuple[torch.Tensor, bytes]:
        """A buffer for a payload that UCX writes outside torch's stream order, and the mark at
        its end (`staging.mark_end`: check it with `end_unwritten` once the payload is in). On a
        GPU it comes from the table's stream, once that stream is idle: memory freed there may
        still be read by a queued scatter (and memory freed on the engine's stream by a queued
        step, so never from that one)."""
        if not self._pool.is_cuda:
            staging = self._pool.empty_staging(num_blocks)
            return staging, mark_end(staging)
        stream = self._gpu_stream()
        with torch.cuda.stream(stream):
            staging = self._pool.empty_staging(num_blocks)
            mark = mark_end(staging)
            idle = torch.cuda.Event()
            idle.record(stream)
        await asyncio.to_thread(idle.synchronize)
        return staging, mark

    async def cut_short(self, staging: torch.Tensor, mark: bytes) -> bool:
        """Whether a payload UCX has received into `staging` (from `staging()`) ended before the
        buffer did (`staging.end_unwritten`). On a GPU its tail is read on the table's stream,
        awaited off the event loop: never behind the engine's queued steps."""
        if not mark:
            return False
        if not self._pool.is_cuda:
            return end_unwritten(staging_tail(staging), mark)
        with torch.cuda.stream(self._gpu_stream()):
            tail = staging_tail(staging).to("cpu", non_blocking=True)
            read = torch.cuda.Event()
            read.record()
        await asyncio.to_thread(read.synchronize)
        return end_unwritten(tail, mark)

    def _gpu_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self._pool.device)
        return self._stream

    def _fail(self, request_id: str, error: TransferError) -> None:
        entry = self._expected.pop(request_id, None)
        if entry is None:
            return
        entry.timer.cancel()
        timer = asyncio.get_running_loop().call_later(self._timeout_s, self._clear_tombstone, request_id)
        self._tombstones[request_id] = (error, timer)
        if not entry.future.done():
            entry.future.set_result(self._result(request_id, entry, "unknown", error))

    def _expire(self, request_id: str) -> None:
        # A writer silent for the whole timeout is hung: break its link, then the blocks are free.
        abort = self._stop_writer(request_id)
        self._fail(request_id, TransferTimeout(f"request {request_id!r}: no KV and no word from its sender "
                                                   f"within {self._timeout_s}s"))
        if abort is not None:
            abort()

    def _stop_writer(self, request_id: str) -> Callable[[], None] | None:
        """Forget the writer of `request_id`, returning how to abort it (None if none)."""
        entry = self._expected.get(request_id)
        if entry is None or entry.writer is None:
            return None
        writer, entry.writer = entry.writer, None
        return writer.abort

    def _expire_early(self, request_id: str) -> None:
        error = TransferRejected(f"request {request_id!r}: receiver never expected it")
        early = self._early.pop(request_id, None)
        if early is not None:
            early.ack(error)
        early_write = self._early_writes.pop(request_id, None)
        if early_write is not None:
            early_write.grant(error)

    def _clear_tombstone(self, request_id: str) -> None:
        tomb = self._tombstones.pop(request_id, None)
        if tomb is not None:
            tomb[1].cancel()

    def _result(
        self, request_id: str, entry: _Expected, transport: str, error: TransferError | None, direct: bool = False,
        ready: torch.cuda.Event | None = None,
    ) -> TransferResult:
        return TransferResult(
            request_id=request_id,
            num_bytes=entry.ids.numel() * self._bytes_per_block,
            transport=transport,
            elapsed_s=time.perf_counter() - entry.started,
            error=error,
            direct=direct,
            ready=ready,
        )
