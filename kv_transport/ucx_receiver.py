"""KVReceiver over UCX: no listener. It waits at worker level for senders' hellos (on
HELLO_TAG: a sender connects to the worker address in our PeerAddress), answers each over
an endpoint made from the sender's worker address, authenticates it, and lands its KV.

One receiver per process: the hellos' tag is the same for all, and a worker-level receive
matches any of them.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Sequence
from typing import Any

import torch
import ucxx

from pdserve.engine.kv.pool import KVLayout
from pdserve.kv_transport.api import HandshakeRefused, PeerAddress, TransferResult
from pdserve.kv_transport.config import TransportConfig
from pdserve.kv_transport.cuda_ipc import export_pool
from pdserve.kv_transport.handshake import HELLO_TAG, data_tag, layout_fields, prove_address
from pdserve.kv_transport.receive_table import ReceiveTable
from pdserve.kv_transport.shards import PoolShards
from pdserve.kv_transport.staging import as_bytes
from pdserve.kv_transport.ucx_inbound import InboundConnection
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

logger = logging.getLogger(__name__)


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
        self._conns: set[InboundConnection] = set()
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
        self._conns.add(InboundConnection(ctl, link, session, self._kv, self._table, self._connection_closed,
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
        # (ucxx makes the endpoint before its first await: no other hello gets in between.)
        link = self._links[hello.worker_address] = await Link.open(hello.worker_address, answers=hello.sn)
        return link

    def _connection_closed(self, conn: InboundConnection, close_link: bool, tell: bool) -> None:
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
        ctl = Control(link.ep, hello.connection_id, initiator=False)
        session = await server_handshake(ctl, hello, self._fields, self._config, self._kv.num_blocks,
                                         self._offer_pool, self._incarnation)
        probe = torch.empty(PROBE_BYTES, dtype=torch.uint8, device=self._kv.device)
        await ucx_io(link.ep.recv(as_bytes(probe), tag=data_tag(session.key, PROBE_ID), force_tag=True))
        return session, ctl, link
