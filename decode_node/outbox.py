"""A decode worker's token deltas, sorted by the frontend that owns each request, and the
frontends' leases.

Several frontends poll one decode worker; each takes the deltas of its own requests only
(the owner is the request id's prefix, `engine.messages.request_owner`), so no frontend's
poll, slow or dead, delays or swallows another's. A poll renews its frontend's lease; a named
frontend silent for `lease_s` is `expired`: the worker aborts its requests. The unnamed
frontend ("": a single server, or a test driving the worker itself) holds no lease.

One writer (the worker's event loop), no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from pdserve.engine.messages import request_owner
from pdserve.engine.outputs import TokenDelta


@dataclass(slots=True)
class _Box:
    last_seen: float
    deltas: list[TokenDelta] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)


class Outboxes:
    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self._boxes: dict[str, _Box] = {}

    def _box(self, owner: str) -> _Box:
        box = self._boxes.get(owner)
        if box is None:
            box = self._boxes[owner] = _Box(asyncio.get_running_loop().time())
        return box

    def put(self, deltas: list[TokenDelta]) -> None:
        """Sort a batch of the engine's deltas into their owners' boxes."""
        for delta in deltas:
            box = self._box(request_owner(delta.request_id))
            box.deltas.append(delta)
            box.ready.set()

    def seen(self, owner: str) -> None:
        """`owner` placed a request here: its lease runs from now if it had none."""
        self._box(owner)

    async def take(self, owner: str, max_wait_s: float) -> list[TokenDelta]:
        """Every delta of `owner`'s requests since its last take (waits up to `max_wait_s` for
        one); renews its lease, at the call and at the answer."""
        box = self._box(owner)
        box.last_seen = asyncio.get_running_loop().time()
        if not box.deltas:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(box.ready.wait(), max_wait_s)
        deltas, box.deltas = box.deltas, []
        box.ready.clear()
        box.last_seen = asyncio.get_running_loop().time()
        return deltas

    def expired(self) -> list[str]:
        """The named owners silent for longer than the lease, forgotten here (their undelivered
        deltas with them); the caller aborts their requests."""
        now = asyncio.get_running_loop().time()
        gone = [o for o, box in self._boxes.items() if o and now - box.last_seen > self.lease_s]
        for owner in gone:
            del self._boxes[owner]
        return gone
