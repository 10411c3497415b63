"""One authenticated sender's connection as a UCX receiver holds it (`ucx_receiver`): it reads
the sender's control frames, posts receives for its data (or grants it the blocks to write into),
refuses a sender that breaks the protocol, and fails the sender's requests when it ends."""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import Callable
from typing import Any

import torch

from pdserve.kv_transport.api import PeerLost, TransferError, TransferRejected, TransferTimeout
from pdserve.kv_transport.handshake import data_tag
from pdserve.kv_transport.receive_table import ReceiveTable
from pdserve.kv_transport.shards import PoolShards
from pdserve.kv_transport.staging import as_bytes
from pdserve.kv_transport.ucx_link import Control, Link, Session, spawn, ucx_io
from pdserve.kv_transport.wire import error_to_wire

logger = logging.getLogger(__name__)


class InboundConnection:
    """One authenticated sender: reads its headers, posts receives for its data."""

    def __init__(
        self, ctl: Control, link: Link, session: Session, kv: PoolShards, table: ReceiveTable,
        on_close: Callable[[InboundConnection, bool, bool], None], timeout_s: float,
    ) -> None:
        self.control = ctl
        self._timeout_s = timeout_s  # the transfer timeout: a payload announced and not sent within it ends us
        self.link = link
        self.connection_id = ctl.connection_id
        self._on_close = on_close
        self._key = session.key
        self._kv = kv
        self._table = table
        self._receiving: set[str] = set()  # message-path requests whose data is awaited
        self._writing: set[str] = set()  # direct-write requests not yet written
        self._copied: list[torch.cuda.Event] = []  # the writer's copy events (CUDA IPC), if opened
        self._copied_handles = ""
        self._tasks: set[asyncio.Task[None]] = set()
        self._farewell: set[asyncio.Task[None]] = set()  # the refusal of a sender that broke the protocol
        self.closed = False
        self._reader = asyncio.create_task(self._read())

    def close(self, close_link: bool = True, tell: bool = True) -> None:
        """Fail this sender's requests. The link to its worker closes too (which cancels the
        receives posted on it), unless the sender gave up in good order with nothing in
        flight; the sender is told, unless it closed the connection itself (`tell` False)."""
        if self.closed:
            return
        self.closed = True
        in_flight = (*self._receiving, *self._writing)
        for request_id in in_flight:
            self._table.failed(request_id, PeerLost(f"request {request_id!r}: sender lost mid-transfer"))
        self._on_close(self, close_link or bool(in_flight), tell)
        for task in (self._reader, *self._tasks):
            task.cancel()

    async def _read(self) -> None:
        try:
            while True:
                try:
                    msg = await self.control.recv()
                    if not self._on_frame(msg):
                        return
                except (KeyError, TypeError, ValueError) as e:  # a frame that breaks the protocol
                    self._refuse(f"malformed control frame: {e!r}")
                    return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - UCX reports a dead peer as assorted errors
            logger.info("KV sender connection closed: %s", e)
        self.close()

    def _on_frame(self, msg: dict[str, Any]) -> bool:
        """Act on one of the sender's frames; False once the connection has ended. Raises
        KeyError, TypeError or ValueError on a malformed one."""
        if msg["t"] == "xfer" and msg.get("mode") == "write":
            self._open_copy_events(str(msg.get("events", "")))
            self._start_write(_request_id(msg))
        elif msg["t"] == "xfer":
            num_blocks = msg["n"]
            if type(num_blocks) is not int:
                raise TypeError(f"xfer of {msg['id']!r}: block count {num_blocks!r} is not an integer")
            self._start_receive(_request_id(msg), num_blocks, str(msg.get("transport", "unknown")))
        elif msg["t"] == "written":
            request_id = _request_id(msg)
            if request_id in self._writing:
                ready = self._copy_event(msg.get("event"))  # a bad index closes us, failing it too
                self._writing.discard(request_id)
                self._table.written(request_id, "cuda_ipc", ready)
        elif msg["t"] == "alive":  # the sender still computes these requests' KV
            ids = msg.get("ids")
            if isinstance(ids, list):
                # Not those whose data it announced: their KV exists, and the wait for it is
                # bounded from the header on, whatever the sender says after.
                self._table.touch([str(i) for i in ids if str(i) not in self._receiving])
        elif msg["t"] == "cancel":
            request_id = _request_id(msg)
            self._writing.discard(request_id)  # a writer that cancels has no copy in flight
            self._table.cancel(request_id, "cancelled by the sender", writer_done=True)
        elif msg["t"] == "closed":  # the sender closed its link
            self.close(tell=False)
            return False
        elif msg["t"] == "refuse":
            logger.warning("KV sender gave up the connection: %s", msg.get("reason"))
            self.close(close_link=False)
            return False
        return True

    def _refuse(self, reason: str, request_id: str | None = None) -> None:
        """The sender broke the protocol: say why (in our log and to it), fail the request it
        named, if any, and end the connection. The receiver serves on."""
        logger.warning("KV sender broke the protocol, connection closed: %s", reason)
        if request_id is not None and request_id not in self._receiving and request_id not in self._writing:
            self._table.failed(request_id, TransferRejected(f"request {request_id!r}: {reason}"))
        # Not among the tasks close() cancels: posted before the link's "closed", it arrives first.
        spawn(self.control.send({"t": "refuse", "reason": reason}), self._farewell)
        self.close()

    def _check_header(self, request_id: str, num_blocks: int | None) -> bool:
        # The sender checks both before sending; a violation means a broken peer.
        if num_blocks is not None and not 0 < num_blocks <= self._kv.num_blocks:
            self._refuse(f"xfer of {request_id!r} names {num_blocks} blocks, the pool has {self._kv.num_blocks}",
                         request_id)
            return False
        if request_id in self._receiving or request_id in self._writing:
            self._refuse(f"xfer of {request_id!r} while its transfer is under way")
            return False
        return True

    def _start_write(self, request_id: str) -> None:
        """The sender will copy into the pool itself (it mapped it): hand it the block ids.
        It may ask before its KV exists (prepare), so it checks the count itself."""
        if self._check_header(request_id, None):
            self._writing.add(request_id)
            self._table.grant(request_id, lambda answer: self._grant(request_id, answer), self.close)

    def _grant(self, request_id: str, answer: torch.Tensor | TransferError) -> None:
        if self.closed:
            return
        if isinstance(answer, TransferError):
            self._writing.discard(request_id)
            self._ack(request_id, answer)
            return
        ids = base64.b64encode(answer.to(torch.int32).numpy().tobytes()).decode()
        grant = {"t": "grant", "id": request_id, "ids": ids, "ordered": bool(self._copied)}
        spawn(self.control.send(grant), self._tasks)

    def _copy_event(self, index: object) -> torch.cuda.Event | None:
        """The writer's event that completes with the copy of a "written" request (None when
        the writer waited for its copy itself). The decode engine admits the request once its
        host sees the event complete, so no step waits for a copy on the GPU."""
        if not self._copied:
            return None
        if not isinstance(index, int) or not 0 <= index < len(self._copied):
            raise ValueError(f"KV writer named copy event {index!r} of {len(self._copied)}")
        return self._copied[index]

    def _open_copy_events(self, handles: str) -> None:
        """Open the writer's copy events once; without them the writer waits for its copies itself."""
        if not handles or handles == self._copied_handles or not self._kv.is_cuda:
            return
        self._copied_handles = handles
        try:
            self._copied = [torch.cuda.Event.from_ipc_handle(self._kv.device, bytes.fromhex(h))
                            for h in handles.split(",")]
        except (RuntimeError, ValueError) as e:
            logger.info("cannot open the KV writer's CUDA events (%s): it will wait for its copies", e)
            self._copied = []

    def _start_receive(self, request_id: str, num_blocks: int, transport: str) -> None:
        if not self._check_header(request_id, num_blocks):
            return
        self._receiving.add(request_id)
        task = asyncio.create_task(self._receive(request_id, num_blocks, transport))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _receive(self, request_id: str, num_blocks: int, transport: str) -> None:
        staging, mark = await self._table.staging(num_blocks)
        try:
            # Posted on the link's endpoint so that closing it (or its error) cancels the receive.
            # Bounded from the header on: a sender that announces data and never sends it is
            # broken, and the receive it leaves posted (and its buffer) goes with the link.
            receive = self.link.ep.recv(as_bytes(staging), tag=data_tag(self._key, request_id), force_tag=True)
            await asyncio.wait_for(ucx_io(receive), self._timeout_s)
        except Exception as e:  # noqa: BLE001
            why = f"not sent within {self._timeout_s:g}s of its header" if isinstance(e, TimeoutError) else \
                f"data receive failed: {e}"
            self._receiving.discard(request_id)
            self._table.failed(request_id, (TransferTimeout if isinstance(e, TimeoutError) else PeerLost)(
                f"request {request_id!r}: {why}"))
            self.close()
            return
        # UCX completes a shorter message as a success: never land what it left unwritten.
        cut_short = await self._table.cut_short(staging, mark)
        self._receiving.discard(request_id)
        if cut_short:
            error = TransferRejected(f"request {request_id!r}: the sender's data ended short of the "
                                     f"{num_blocks} blocks its header announced")
            logger.warning("KV sender broke the protocol: %s", error)
            self._table.failed(request_id, error)
            self._ack(request_id, error)
            return
        self._table.landed(request_id, staging, transport, lambda error: self._ack(request_id, error))

    def _ack(self, request_id: str, error: TransferError | None) -> None:
        if self.closed:
            return
        spawn(self.control.send({"t": "done", "id": request_id, "error": error_to_wire(error)}), self._tasks)


def _request_id(msg: dict[str, Any]) -> str:
    request_id = msg["id"]
    if not isinstance(request_id, str) or not request_id:
        raise TypeError(f"{msg['t']!r} frame: request id {request_id!r} is not a string")
    return request_id
