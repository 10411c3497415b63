"""A sender's connection to one receiver over a UCX link (ucx_link): the grants it asks for,
the direct writes or data messages of its requests, keep-alives, and the reader of the
receiver's control messages. `UcxKVSender` (ucx_sender) makes, keeps and closes them."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pdserve.kv_transport.api import PeerAddress, PeerLost, TransferError, TransferRejected
from pdserve.kv_transport.faults import TransferFault
from pdserve.kv_transport.handshake import data_tag
from pdserve.kv_transport.pool_writer import PoolWriter
from pdserve.kv_transport.staging import as_bytes, has_repeats, staging_num_blocks
from pdserve.kv_transport.ucx_link import Control, Session, spawn, ucx_io
from pdserve.kv_transport.wire import error_from_wire

COPY_EVENTS = 8  # per receiver: the direct copies' completion events, recorded in turn


class Connection:
    """An authenticated link to one receiver; fails all its transfers when it breaks."""

    def __init__(
        self, peer: PeerAddress, ctl: Control, session: Session, transport: str,
        on_close: Callable[[Connection], None], kv: torch.Tensor | None, peer_kv: torch.Tensor | None = None,
    ) -> None:
        self.peer = peer
        # The receiver's pool mapped into this process: KV is written straight into it.
        self.peer_kv = peer_kv
        # (peer_kv is only opened for a one-rank pool `kv`: see UcxKVSender._open_peer_pool.)
        self._writer = PoolWriter(kv, peer_kv) if kv is not None and peer_kv is not None else None
        # Recorded after each copy, in turn; the receiver opens them (CUDA IPC) and hands the
        # one named in "written" to its engine, which uses the KV once its host sees it
        # complete (a stream wait on another process's event lags ~85 us on the H200s; a
        # host query sees it at once). A later copy that re-records an event before the
        # receiver looked only delays that look: the copies run in order on one stream.
        self._copied: list[torch.cuda.Event] = []
        self._copied_handles = ""
        self._next_event = 0
        if peer_kv is not None and peer_kv.is_cuda:
            self._copied = [torch.cuda.Event(interprocess=True) for _ in range(COPY_EVENTS)]
            with torch.cuda.device(peer_kv.device):  # our GPU (the mapping is opened on it)
                self._copied_handles = ",".join(bytes(e.ipc_handle()).hex() for e in self._copied)  # creates them
        self._receiver_orders = False  # the receiver could open that event (from its grants)
        self._on_close = on_close
        self.transport = transport
        self.peer_num_blocks = session.peer_num_blocks
        self.control = ctl
        self._key = session.key
        self._acks: dict[str, asyncio.Future[TransferError | None]] = {}
        self._grants: dict[str, asyncio.Future[np.ndarray | TransferError]] = {}
        # Each data send keeps its staging buffer alive until UCX is done with it.
        self._data: dict[str, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.error: TransferError | None = None
        self._reader = asyncio.create_task(self._read())

    @property
    def closed(self) -> bool:
        return self.error is not None

    async def transfer(self, request_id: str, staging: torch.Tensor,
                       fault: TransferFault | None = None) -> TransferError | None:
        """Send one request's staging buffer; return the receiver's verdict. `fault`: a
        test's way to break it (faults.py)."""
        if self.error is not None:
            return self.error
        ack: asyncio.Future[TransferError | None] = asyncio.get_running_loop().create_future()
        self._acks[request_id] = ack
        num_blocks = staging_num_blocks(staging)
        header = {"t": "xfer", "id": request_id, "n": num_blocks, "transport": self.transport}
        try:
            await self.control.send(header)
            payload = as_bytes(staging)
            if fault is not None and fault.action == "close":
                self.close(PeerLost(f"{self.peer}: link closed mid-transfer (an injected fault)"))
                return self.error
            if fault is not None and fault.action == "truncate":
                payload = payload[:len(payload) * min(fault.after_blocks, num_blocks - 1) // num_blocks]
            if fault is None or fault.action != "stall":
                task = asyncio.create_task(self._send_data(request_id, payload))
                self._data[request_id] = task
                task.add_done_callback(lambda _: self._data.pop(request_id, None))
            return await ack
        except asyncio.CancelledError:
            # The caller gave up (cancel or timeout): let the receiver resolve its expect() now.
            self._cancel_remote(request_id)
            raise
        except Exception as e:  # noqa: BLE001 - the header could not be sent: the link is gone
            self.close(PeerLost(f"{self.peer}: connection lost: {e}"))
            return self.error
        finally:
            self._acks.pop(request_id, None)

    async def keep_alive(self, request_ids: list[str]) -> None:
        """Tell the receiver we still work on `request_ids` (see keepalive.py)."""
        if not self.closed:
            await self.control.send({"t": "alive", "ids": request_ids})

    def request_grant(self, request_id: str) -> None:
        """Ask the receiver for the blocks of `request_id` now; `write` uses the answer."""
        if request_id in self._grants:
            return
        grant: asyncio.Future[np.ndarray | TransferError] = asyncio.get_running_loop().create_future()
        self._grants[request_id] = grant
        if self.error is not None:
            grant.set_result(self.error)
            return
        header: dict[str, Any] = {"t": "xfer", "id": request_id, "mode": "write"}
        if self._copied_handles:
            header["events"] = self._copied_handles
        spawn(self._send_or_close(header), self._tasks)

    def withdraw(self, request_id: str) -> None:
        """Give back a grant that `write` will not use (the receiver may free its blocks)."""
        if self._grants.pop(request_id, None) is not None:
            self._cancel_remote(request_id)

    def _cancel_remote(self, request_id: str) -> None:
        """Tell the receiver we are done with `request_id` without landing it (it frees)."""
        if not self.closed:
            spawn(self.control.send({"t": "cancel", "id": request_id}), self._tasks)

    async def write(self, request_id: str, ids: torch.Tensor, after: torch.cuda.Event | None) -> TransferError | None:
        """Copy blocks `ids` of the local pool straight into the blocks the receiver grants
        (once `after` has completed, if given)."""
        assert self._writer is not None
        self.request_grant(request_id)  # no-op when prepared ahead
        written = False
        try:
            answer = await self._grants[request_id]
            if isinstance(answer, TransferError):
                self._grants.pop(request_id, None)
                return answer
            if len(answer) != ids.numel():
                self.withdraw(request_id)
                return TransferRejected(f"request {request_id!r}: {ids.numel()} blocks, {self.peer} expects "
                                        f"{len(answer)}")
            del self._grants[request_id]
            slot = self._writer.write(ids.numpy().astype(np.int32), answer, after)
            written = True
            copied = None
            try:
                if self._copied:
                    index = self._next_event
                    self._next_event = (index + 1) % len(self._copied)
                    copied = self._copied[index]
                    copied.record(self._writer.stream)
                    if self._receiver_orders:
                        # "written" travels while the copy runs: the receiver uses the KV once
                        # it sees the event complete.
                        await self.control.send({"t": "written", "id": request_id, "event": index})
                        # Our blocks are free for reuse once the copy is done; the loop keeps
                        # serving meanwhile (a 16k-token copy takes ~6 ms).
                        await asyncio.to_thread(copied.synchronize)
                        copied = None  # done (a later copy may re-record it: no second wait)
                        return None
                    copied.synchronize()
                    copied = None
                # Not awaited: the receiver learns it one message later; if that message is lost,
                # so is the link, and the receiver fails the request (its caller frees the blocks).
                spawn(self._send_or_close({"t": "written", "id": request_id}), self._tasks)
                return None
            finally:
                if copied is not None:
                    # Cancelled or failed mid-way: nothing of ours touches either pool once we return.
                    copied.synchronize()
                self._writer.release(slot)
        except asyncio.CancelledError:
            # Before the copy: the grant goes back. After it (done, see above): "written" may
            # not have left; the cancel frees the blocks either way.
            self._grants.pop(request_id, None)
            self._cancel_remote(request_id)
            raise
        except Exception as e:  # noqa: BLE001 - a frame could not be sent: the link is gone
            self.close(PeerLost(f"{self.peer}: connection lost{' after writing' if written else ''}: {e}"))
            return self.error

    async def _send_or_close(self, msg: dict[str, Any]) -> None:
        try:
            await self.control.send(msg)
        except Exception as e:  # noqa: BLE001 - the link is gone
            self.close(PeerLost(f"{self.peer}: connection lost: {e}"))

    def data_in_flight(self, request_id: str) -> bool:
        return request_id in self._data

    def close(self, error: TransferError) -> None:
        """Fail every transfer of this connection. The owner then closes its link (see
        ucx_link.Link), which cancels the receives and sends UCX still has in flight."""
        if self.error is not None:
            return
        self.error = error
        for waiter in (*self._acks.values(), *self._grants.values()):
            if not waiter.done():
                waiter.set_result(error)
        self._on_close(self)
        for task in (self._reader, *self._data.values(), *self._tasks):
            task.cancel()

    async def _send_data(self, request_id: str, payload: Any) -> None:
        """`payload`: the staging buffer's bytes (`as_bytes`), which it keeps alive until UCX is done."""
        try:
            await ucx_io(self.control.ep.send(payload, tag=data_tag(self._key, request_id), force_tag=True))
        except Exception as e:  # noqa: BLE001 - any UCX failure means the link is gone
            self.close(PeerLost(f"{self.peer}: data send failed: {e}"))

    async def _read(self) -> None:
        try:
            while True:
                msg = await self.control.recv()
                if msg["t"] == "grant":
                    self._receiver_orders = bool(msg.get("ordered"))
                    self._resolve_grant(str(msg["id"]), self._granted_ids(msg))
                elif msg["t"] == "done":
                    error = error_from_wire(msg.get("error"))
                    ack = self._acks.get(msg["id"])
                    if ack is not None and not ack.done():
                        ack.set_result(error)
                    if error is not None:
                        self._resolve_grant(str(msg["id"]), error)
                elif msg["t"] == "refuse":  # we broke the protocol (a bug, or an injected fault)
                    self.close(TransferRejected(f"{self.peer} refused the connection: {msg.get('reason', '?')}"))
                    return
                elif msg["t"] == "closed":
                    self.close(PeerLost(f"{self.peer} closed the connection"))
                    return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - UCX reports a dead peer as assorted errors
            self.close(PeerLost(f"{self.peer}: connection lost: {e}"))


    def _resolve_grant(self, request_id: str, answer: torch.Tensor | TransferError) -> None:
        # No waiter: we gave up on it, and our cancel frees the blocks on the receiver.
        grant = self._grants.get(request_id)
        if grant is not None and not grant.done():
            grant.set_result(answer)

    def _granted_ids(self, msg: dict[str, Any]) -> np.ndarray:
        """Block ids (int32) from a grant frame, checked against the receiver's pool (a bad
        one breaks the link)."""
        ids = np.frombuffer(base64.b64decode(msg["ids"]), dtype=np.int32)
        if ids.size == 0 or ids.min() < 0 or ids.max() >= self.peer_num_blocks:
            raise ValueError(f"grant for {msg['id']!r} names blocks outside the receiver's pool")
        if has_repeats(ids, self.peer_num_blocks):
            raise ValueError(f"grant for {msg['id']!r} repeats a block")
        return ids
