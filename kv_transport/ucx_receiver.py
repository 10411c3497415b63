"""KVReceiver over UCX: a listener that authenticates senders and lands their KV."""

from __future__ import annotations

import asyncio
import base64
import logging
import secrets
from collections.abc import Callable, Sequence
from typing import Any

import torch
import ucxx

from pdserve.engine.kv_pool import KVLayout
from pdserve.kv_transport.api import HandshakeRefused, PeerAddress, PeerLost, TransferError, TransferResult
from pdserve.kv_transport.config import TransportConfig
from pdserve.kv_transport.cuda_ipc import export_pool
from pdserve.kv_transport.handshake import data_tag, layout_fields
from pdserve.kv_transport.receive_table import ReceiveTable
from pdserve.kv_transport.shards import PoolShards
from pdserve.kv_transport.staging import as_bytes
from pdserve.kv_transport.ucx_link import (
    PROBE_BYTES,
    PROBE_ID,
    Control,
    Session,
    ensure_ucx,
    server_handshake,
    spawn,
    ucx_io,
)
from pdserve.kv_transport.wire import error_to_wire

logger = logging.getLogger(__name__)


class _Connection:
    """One authenticated sender: reads its headers, posts receives for its data."""

    def __init__(
        self, ctl: Control, session: Session, kv: PoolShards, table: ReceiveTable,
        on_close: Callable[[_Connection], None],
    ) -> None:
        self._ctl = ctl
        self._on_close = on_close
        self._key = session.key
        self._kv = kv
        self._table = table
        self._receiving: set[str] = set()  # message-path requests whose data is awaited
        self._writing: set[str] = set()  # direct-write requests not yet written
        self._copied: list[torch.cuda.Event] = []  # the writer's copy events (CUDA IPC), if opened
        self._copied_handles = ""
        self._tasks: set[asyncio.Task[None]] = set()
        self.closed = False
        self._reader = asyncio.create_task(self._read())

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for request_id in (*self._receiving, *self._writing):
            self._table.failed(request_id, PeerLost(f"request {request_id!r}: sender lost mid-transfer"))
        self._ctl.abort()  # also cancels the receives posted for in-flight data
        for task in (self._reader, *self._tasks):
            task.cancel()
        self._on_close(self)

    async def _read(self) -> None:
        try:
            while True:
                msg = await self._ctl.recv()
                if msg["t"] == "xfer" and msg.get("mode") == "write":
                    self._open_copy_events(str(msg.get("events", "")))
                    self._start_write(str(msg["id"]))
                elif msg["t"] == "xfer":
                    self._start_receive(str(msg["id"]), int(msg["n"]), str(msg.get("transport", "unknown")))
                elif msg["t"] == "written":
                    request_id = str(msg["id"])
                    if request_id in self._writing:
                        ready = self._copy_event(msg.get("event"))  # a bad index closes us, failing it too
                        self._writing.discard(request_id)
                        self._table.written(request_id, "cuda_ipc", ready)
                elif msg["t"] == "alive":  # the sender still computes these requests' KV
                    ids = msg.get("ids")
                    if isinstance(ids, list):
                        self._table.touch([str(i) for i in ids])
                elif msg["t"] == "cancel":
                    request_id = str(msg["id"])
                    self._writing.discard(request_id)  # a writer that cancels has no copy in flight
                    self._table.cancel(request_id, "cancelled by the sender", writer_done=True)
                elif msg["t"] == "refuse":
                    logger.warning("KV sender gave up the connection: %s", msg.get("reason"))
                    break
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - UCX reports a dead peer as assorted errors
            logger.info("KV sender connection closed: %s", e)
        self.close()

    def _check_header(self, request_id: str, num_blocks: int | None) -> bool:
        bad_count = num_blocks is not None and not 0 < num_blocks <= self._kv.num_blocks
        if bad_count or request_id in self._receiving or request_id in self._writing:
            # The sender checks both before sending; a violation means a broken peer.
            logger.warning("KV sender broke the protocol (request %r, %d blocks)", request_id, num_blocks)
            self.close()
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
        spawn(self._ctl.send(grant), self._tasks)

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
        staging = await self._table.staging(num_blocks)
        try:
            # Posted on the control endpoint so that closing it cancels the receive.
            await ucx_io(self._ctl.ep.recv(as_bytes(staging), tag=data_tag(self._key, request_id), force_tag=True))
        except Exception as e:  # noqa: BLE001
            self._receiving.discard(request_id)
            self._table.failed(request_id, PeerLost(f"request {request_id!r}: data receive failed: {e}"))
            self.close()
            return
        self._receiving.discard(request_id)
        self._table.landed(request_id, staging, transport, lambda error: self._ack(request_id, error))

    def _ack(self, request_id: str, error: TransferError | None) -> None:
        if self.closed:
            return
        spawn(self._ctl.send({"t": "done", "id": request_id, "error": error_to_wire(error)}), self._tasks)


class UcxKVReceiver:
    """KVReceiver over ucxx. Create with `await UcxKVReceiver.start(...)`."""

    def __init__(self, kv: torch.Tensor | PoolShards, layout: KVLayout, config: TransportConfig) -> None:
        """kv: the pool [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], or
        the pools of a tensor-parallel worker's ranks; layout: the one-rank layout of the
        model's KV (what the wire carries)."""
        ensure_ucx(config)
        self._kv = PoolShards.of(kv)
        self._config = config
        self._fields = layout_fields(layout)
        self._table = ReceiveTable(self._kv, config.transfer_timeout_s)
        self._conns: set[_Connection] = set()
        self._listener: Any = None
        self._port = 0
        # This receiver's life: one restarted at the same address is another (see PeerAddress).
        self._incarnation = secrets.token_hex(8)

    @classmethod
    async def start(cls, kv: torch.Tensor | PoolShards, layout: KVLayout, config: TransportConfig) -> UcxKVReceiver:
        receiver = cls(kv, layout, config)
        # ucxx binds 0.0.0.0 whatever listen_host says (create_listener takes a port, and so does
        # its C++ ListenerBuilder): the one listener of a local cluster off loopback. The
        # handshake's HMAC proof of the cluster secret keeps strangers out.
        receiver._listener = ucxx.create_listener(receiver._on_connect, port=config.listen_port)
        receiver._port = receiver._listener.port
        return receiver

    @property
    def address(self) -> PeerAddress:
        return PeerAddress(self._config.listen_host, self._port, self._incarnation)

    @property
    def num_connections(self) -> int:
        return len(self._conns)

    @property
    def num_pending(self) -> int:
        return self._table.num_pending

    def expect(self, request_id: str, block_ids: Sequence[int]) -> asyncio.Future[TransferResult]:
        return self._table.expect(request_id, block_ids)

    def cancel(self, request_id: str) -> None:
        self._table.cancel(request_id)

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for conn in list(self._conns):
            conn.close()
        self._table.close()

    def _offer_pool(self) -> dict[str, Any] | None:
        """The pool's CUDA IPC handle for a sender's direct writes (fresh per sender); none
        for a tensor-parallel worker's ranks, whose KV arrives by messages."""
        kv = self._kv.single
        if kv is None or not (self._config.direct_writes and kv.is_cuda):
            return None
        try:
            return export_pool(kv)
        except RuntimeError as e:
            logger.warning("cannot share the KV pool over CUDA IPC, senders will use UCX messages: %s", e)
            return None

    async def _on_connect(self, ep: Any) -> None:
        # Must be `async def`: ucxx never awaits a coroutine returned by a plain callable.
        ctl = Control(ep)
        try:
            session = await asyncio.wait_for(self._accept(ctl), self._config.connect_timeout_s)
        except (HandshakeRefused, asyncio.TimeoutError) as e:
            logger.warning("KV sender refused: %s", e)
            ctl.abort()
            return
        except Exception as e:  # noqa: BLE001 - a peer that vanished mid-handshake
            logger.info("KV sender lost during the handshake: %s", e)
            ctl.abort()
            return
        if self._listener is None:  # closed while this sender was shaking hands
            ctl.abort()
            return
        self._conns.add(_Connection(ctl, session, self._kv, self._table, self._conns.discard))

    async def _accept(self, ctl: Control) -> Session:
        session = await server_handshake(ctl, self._fields, self._config, self._kv.num_blocks, self._offer_pool,
                                         self._incarnation)
        probe = torch.empty(PROBE_BYTES, dtype=torch.uint8, device=self._kv.device)
        await ucx_io(ctl.ep.recv(as_bytes(probe), tag=data_tag(session.key, PROBE_ID), force_tag=True))
        return session
