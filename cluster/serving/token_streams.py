"""The decode workers' token deltas, to the requests that wait for them.

One poller per decode worker long-polls its batched token deltas and fans them out to the
requests' queues. A request's queue takes deltas from the worker it was opened on only (fenced:
a request continued elsewhere takes nothing more from a worker it left).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from pdserve.cluster.serving.pools import ACTOR_LOST, Pool, Worker
from pdserve.engine.outputs import TokenDelta, merge_deltas
from pdserve.engine.sequence import FinishReason

# A request's deltas from its decode worker, and the error that ends them, if one does.
StreamQueue = asyncio.Queue[TokenDelta | Exception]


async def take_coalesced(queue: StreamQueue) -> TokenDelta | Exception:
    """The next item of a request's stream, with the deltas already queued behind it merged in:
    a stream whose reader fell behind (a slow client, a busy frontend) sends one chunk for all
    it missed instead of one per step, as vLLM's and SGLang's servers do. An error, and an
    abort (its tokens are not the answer's), are never merged: they come on their own."""
    item = await queue.get()
    if isinstance(item, Exception) or item.finished or queue.empty():
        return item
    parts = [item]
    while not queue.empty():
        nxt = queue._queue[0]  # noqa: SLF001 - a peek: an error or an abort stays queued
        if isinstance(nxt, Exception) or nxt.finish_reason is FinishReason.ABORT:
            break
        parts.append(queue.get_nowait())
        if nxt.finished:
            break
    return merge_deltas(parts)


@dataclass(slots=True)
class _Stream:
    decode: Worker
    queue: StreamQueue = field(default_factory=asyncio.Queue)


class TokenStreams:
    def __init__(self, decode: Pool, poll_wait_s: float, frontend_id: str = "") -> None:
        self.decode = decode
        self.poll_wait_s = poll_wait_s  # how long one poll waits for deltas
        self.frontend_id = frontend_id  # whose requests' deltas a poll takes (and whose lease it renews)
        self._streams: dict[str, _Stream] = {}
        self._pollers: dict[str, asyncio.Task[None]] = {}

    def open(self, request_id: str, decode: Worker) -> StreamQueue:
        """The queue of `request_id`'s deltas from `decode` (and the error that ends them, if one does)."""
        stream = self._streams[request_id] = _Stream(decode)
        return stream.queue

    def close(self, request_id: str) -> None:
        del self._streams[request_id]

    def follow(self, worker: Worker) -> None:
        """Poll `worker` for deltas, unless a poller already does."""
        if worker.worker_id not in self._pollers:
            self._pollers[worker.worker_id] = asyncio.create_task(self._poll(worker))

    def leave(self, worker: Worker, error: Exception) -> None:
        """`worker` left (lost, or drained and stopped): the streams still open on it end with
        `error`, and its poller stops (unless the poller is the caller: a poll that found the
        worker lost ends by itself once its replacement began)."""
        task = self._pollers.pop(worker.worker_id, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        self.move(worker, error)

    def move(self, worker: Worker, error: Exception) -> None:
        """`worker`'s requests' streams end with `error` behind the deltas already queued: a
        WorkerLost, which their coordinators answer by continuing them elsewhere (a drain past
        its deadline calls this alone: its poller goes on while the worker lives)."""
        for stream in self._streams.values():
            if stream.decode is worker:
                stream.queue.put_nowait(error)

    def stop(self) -> None:
        for task in self._pollers.values():
            task.cancel()

    async def _poll(self, worker: Worker) -> None:
        while worker.state.healthy:
            try:
                deltas = await (worker.actor.poll.remote(self.poll_wait_s, self.frontend_id) if self.frontend_id
                                else worker.actor.poll.remote(self.poll_wait_s))
            except ACTOR_LOST:
                await self.decode.replace(worker)
                return
            for delta in deltas:
                stream = self._streams.get(delta.request_id)
                if stream is not None and stream.decode is worker:
                    stream.queue.put_nowait(delta)
