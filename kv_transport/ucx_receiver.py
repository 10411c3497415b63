"""KVReceiver over UCX: no listener. It waits at worker level for senders' hellos (on
HELLO_TAG: a sender connects to the worker address in our PeerAddress), answers each over
an endpoint made from the sender's worker address, authenticates it, and lands its KV.

One receiver per process: the hellos' tag is the same for all, and a worker-level receive
matches any of them.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import secrets
from collections.abc import Callable, Sequence
from typing import Any

import torch
import ucxx

from pdserve.engine.kv.pool import KVLayout
from pdserve.kv_transport.api import (
    HandshakeRefused,
    PeerAddress,
    PeerLost,
    TransferError,
    TransferRejected,
    TransferResult,
    TransferTimeout,
)
from pdserve.kv_transport.config import TransportConfig
from pdserve.kv_transport.cuda_ipc import export_pool
from pdserve.kv_transport.handshake import HELLO_TAG, data_tag, layout_fields, prove_address
from pdserve.kv_transport.receive_table import ReceiveTable
from pdserve.kv_transport.shards import PoolShards
from pdserve.kv_transport.staging import as_bytes
from pdserve.kv_transport.ucx_link import (
    PROBE_BYTES,
    PROBE_ID,
    Control,
    Hello,
    Link,
    Session,
    UcxIOError,
    ensure_ucx,
    frame_buffer,
    parse_frame,
    server_handshake,
    spawn,
    ucx_io,
)
from pdserve.kv_transport.wire import error_to_wire

logger = logging.getLogger(__name__)


class _Connection:
    """One authenticated sender: reads its headers, posts receives for its data."""

    def __init__(
        self, ctl: Control, link: Link, session: Session, kv: PoolShards, table: ReceiveTable,
        on_close: Callable[[_Connection, bool, bool], None], timeout_s: float,
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
            receive = self.link.ctl_ep.recv(as_bytes(staging), tag=data_tag(self._key, request_id), force_tag=True)
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


MAX_HANDSHAKES = 64  # hellos answered at once; more are dropped (their senders time out and retry)


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
        self._links: dict[bytes, Link] = {}  # endpoints back to senders' workers, one each (see Link)
        # Connection ids of senders shaking hands or connected: a hello naming one again
        # (a replay, or a broken sender) is dropped, so that no two readers share its tags.
        self._connection_ids: set[bytes] = set()
        self._handshakes: set[asyncio.Task[None]] = set()
        self._retiring: set[asyncio.Task[None]] = set()  # links telling their senders, then aborting
        self._hellos: asyncio.Task[None] | None = None
        self._closed = False
        # This receiver's life: one restarted at the same address is another (see PeerAddress).
        self._incarnation = secrets.token_hex(8)
        address = bytes(ucxx.get_worker_address())
        self._address = PeerAddress(config.listen_host, address, self._incarnation,
                                    prove_address(config.secret, address))

    @classmethod
    async def start(cls, kv: torch.Tensor | PoolShards, layout: KVLayout, config: TransportConfig) -> UcxKVReceiver:
        receiver = cls(kv, layout, config)
        receiver._hellos = asyncio.create_task(receiver._serve_hellos())
        return receiver

    @property
    def address(self) -> PeerAddress:
        return self._address

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
        if self._closed:
            return
        self._closed = True
        for task in self._handshakes:
            task.cancel()
        retiring = [self._close_link(address) for address in list(self._links)]
        for conn in list(self._conns):
            conn.close()
        self._table.close()
        await asyncio.gather(*(t for t in retiring if t is not None), return_exceptions=True)
        if self._hellos is not None:
            await self._release_hello_receive()
            self._hellos.cancel()

    async def _release_hello_receive(self) -> None:
        """Complete our receive of hellos with a frame of our own. A worker-level receive
        cannot be withdrawn alone; left posted, it would take the next hello to this process."""
        ep = None
        try:
            address = ucxx.get_ucx_address_from_buffer(self._address.worker_address)
            ep = await ucx_io(ucxx.create_endpoint_from_worker_address(address, endpoint_error_handling=False))
            ctl = Control(ep, bytes(8), initiator=True)
            await asyncio.wait_for(ctl.send({"t": "closed"}, tag=HELLO_TAG), self._config.connect_timeout_s)
            await asyncio.wait_for(asyncio.shield(self._hellos), self._config.connect_timeout_s)
        except (UcxIOError, asyncio.TimeoutError) as e:
            logger.info("KV receiver's wait for hellos not released: %s", e)
        finally:
            if ep is not None:
                ep.abort(period=10**8)

    async def _serve_hellos(self) -> None:
        while not self._closed:
            buf = frame_buffer()
            try:
                await ucx_io(ucxx.recv(buf, HELLO_TAG))
                msg = parse_frame(buf)
            except UcxIOError as e:
                if "Canceled" in str(e):  # ucxx is shutting down
                    return
                logger.warning("KV hello not received: %s", e)  # e.g. a stranger's oversized message
                continue
            except ValueError as e:
                logger.warning("KV hello dropped: %s", e)
                continue
            if self._closed:
                return
            try:
                hello = Hello.parse(msg, self._config.secret)
            except ValueError as e:
                logger.warning("KV hello dropped: %s", e)
                continue
            if hello.connection_id in self._connection_ids or len(self._handshakes) >= MAX_HANDSHAKES:
                logger.warning("KV hello dropped: connection id in use, or %d handshakes running", MAX_HANDSHAKES)
                continue
            self._connection_ids.add(hello.connection_id)
            task = asyncio.create_task(self._on_hello(hello))
            self._handshakes.add(task)
            task.add_done_callback(self._handshakes.discard)

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

    async def _on_hello(self, hello: Hello) -> None:
        accepted: tuple[Session, Control, Link] | None = None
        try:
            # Bounded as a whole: the endpoint back, the handshake and the probe.
            accepted = await asyncio.wait_for(self._accept(hello), self._config.connect_timeout_s)
        except HandshakeRefused as e:  # said and done: nothing of it is left in flight on the link
            logger.warning("KV sender refused: %s", e)
        except asyncio.CancelledError:  # close()
            pass
        except Exception as e:  # noqa: BLE001 - timed out, vanished mid-handshake, or malformed
            logger.warning("KV sender lost during the handshake: %s", e or type(e).__name__)
            # A receive may still be posted on its link (not on a newer one, which the sender
            # may have opened meanwhile).
            self._close_link(hello.worker_address, answers=hello.sn)
        # Failed, or closed (the receiver, or the link by another connection's failure) meanwhile.
        if accepted is None or self._closed or self._links.get(hello.worker_address) is not accepted[2]:
            self._connection_ids.discard(hello.connection_id)
            return
        session, ctl, link = accepted
        self._conns.add(_Connection(ctl, link, session, self._kv, self._table, self._connection_closed,
                                    self._config.transfer_timeout_s))

    async def _link_for(self, hello: Hello) -> Link:
        """Our link back for the sender's link that the hello names (see Link): the one we
        hold for it, or one opened now (after closing ours for an older link of the sender's,
        which it has given up). The hello's proof was checked: its address is a genuine one."""
        link = self._links.get(hello.worker_address)
        if link is not None and link.answers == hello.sn:
            return link
        if link is not None and link.answers > hello.sn:
            raise HandshakeRefused(f"a hello for an old link ({hello.sn}): its sender has moved on")
        self._close_link(hello.worker_address, tell=False)
        # (ucxx makes both endpoints before its first await: no other hello gets in between.)
        link = self._links[hello.worker_address] = await Link.open(hello.worker_address, answers=hello.sn)
        return link

    def _connection_closed(self, conn: _Connection, close_link: bool, tell: bool) -> None:
        if close_link:  # (while `conn` is still ours: the sender is told over it too)
            self._close_link(next((a for a, link in self._links.items() if link is conn.link), b""), tell=tell)
        self._conns.discard(conn)
        self._connection_ids.discard(conn.connection_id)

    def _close_link(
        self, worker_address: bytes, answers: int | None = None, tell: bool = True,
    ) -> asyncio.Task[None] | None:
        """Close our link to a sender's worker (only if it answers the sender's link
        `answers`, when given), and every connection over it, telling the sender over each
        (unless it has moved on to a newer link: `tell` False). Returns the task that tells,
        then aborts the link."""
        link = self._links.get(worker_address)
        if link is None or answers is not None and link.answers != answers:
            return None
        del self._links[worker_address]
        conns = [c for c in self._conns if c.link is link]
        for conn in conns:
            conn.close()
        if not (tell and conns):
            link.abort()
            return None
        return spawn(link.retire([c.control for c in conns], self._config.connect_timeout_s), self._retiring)

    async def _accept(self, hello: Hello) -> tuple[Session, Control, Link]:
        link = await self._link_for(hello)
        ctl = Control(link.ctl_ep, hello.connection_id, initiator=False)
        session = await server_handshake(ctl, hello, self._fields, self._config, self._kv.num_blocks,
                                         self._offer_pool, self._incarnation)
        probe = torch.empty(PROBE_BYTES, dtype=torch.uint8, device=self._kv.device)
        await ucx_io(link.ctl_ep.recv(as_bytes(probe), tag=data_tag(session.key, PROBE_ID), force_tag=True))
        return session, ctl, link
