"""A sender's word to its receivers that it is still computing the KV they wait for.

A receiver bounds its wait for a request's KV by the transfer timeout; the prefill that
computes that KV may take far longer (minutes for a long prompt on a CPU). So a sender
names, every `interval_s` (a quarter of the timeout), the requests it has prepared and
not yet sent, and the receiver starts their waits over (`ReceiveTable.touch`): the
bound then measures the sender's silence, not the prefill's length. A sender that dies
or hangs falls silent, and its requests time out as before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from pdserve.kv_transport.api import PeerAddress

logger = logging.getLogger(__name__)

MAX_IDS_PER_FRAME = 1000  # request ids are ~32 characters: a frame stays far below MAX_FRAME_BYTES

Notify = Callable[[PeerAddress, list[str]], Awaitable[None]]


class KeepAlive:
    """Request ids prepared for each peer, named to it every `interval_s` until they are
    sent or forgotten. `notify(peer, ids)` delivers one batch; its failures are only logged
    (a broken link fails its transfers by itself)."""

    def __init__(self, interval_s: float, notify: Notify) -> None:
        self.interval_s = interval_s
        self._notify = notify
        self._pending: dict[str, PeerAddress] = {}
        self._task: asyncio.Task[None] | None = None

    def add(self, request_id: str, peer: PeerAddress) -> None:
        """Call from the event loop; starts the beat if it is not running."""
        self._pending[request_id] = peer
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())

    def discard(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    def close(self) -> None:
        self._pending.clear()
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while self._pending:
            await asyncio.sleep(self.interval_s)
            by_peer: dict[PeerAddress, list[str]] = {}
            for request_id, peer in self._pending.items():
                by_peer.setdefault(peer, []).append(request_id)
            for peer, ids in by_peer.items():
                for start in range(0, len(ids), MAX_IDS_PER_FRAME):
                    try:
                        await self._notify(peer, ids[start:start + MAX_IDS_PER_FRAME])
                    except Exception as e:  # noqa: BLE001 - the link's own reader handles its loss
                        logger.debug("keep-alive to %s not sent: %s", peer, e)
