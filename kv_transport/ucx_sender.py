"""KVSender over UCX: one authenticated connection per receiver (made from its worker
address, see ucx_link), one data message per request."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.engine.kv.pool import KVLayout
from pdserve.kv_transport.api import (
    HandshakeRefused,
    PeerAddress,
    PeerLost,
    PeerReplaced,
    SlowPathRefused,
    TransferCancelled,
    TransferError,
    TransferRejected,
    TransferResult,
    TransferTimeout,
)
from pdserve.kv_transport.config import TransportConfig
from pdserve.kv_transport.cuda_ipc import open_pool
from pdserve.kv_transport.faults import TransferFault
from pdserve.kv_transport.handshake import data_tag, layout_fields, new_connection_id, prove_address
from pdserve.kv_transport.keepalive import KeepAlive
from pdserve.kv_transport.shards import PoolShards
from pdserve.kv_transport.staging import as_bytes, check_block_ids
from pdserve.kv_transport.transport_info import ep_info, transport_from_ep_info
from pdserve.kv_transport.ucx_connection import Connection
from pdserve.kv_transport.ucx_link import (
    PROBE_BYTES,
    PROBE_ID,
    Control,
    Link,
    Session,
    client_handshake,
    ensure_ucx,
    spawn,
    ucx_io,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Attempt:
    """What one send() got to before it ended (it may be cut short by the timeout)."""

    conn: Connection | None = None


class UcxKVSender:
    """KVSender over ucxx. Use inside the event loop that will drive it."""

    def __init__(self, kv: torch.Tensor | PoolShards, layout: KVLayout, config: TransportConfig) -> None:
        """kv: the pool [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], or
        the pools of a tensor-parallel worker's ranks; layout: the one-rank layout of the
        model's KV (what the wire carries)."""
        ensure_ucx(config)
        self._pool = PoolShards.of(kv)
        self._config = config
        self._fields = layout_fields(layout)
        self._bytes_per_block = self._pool.bytes_per_block
        self._conns: dict[PeerAddress, Connection] = {}
        self._connecting: dict[PeerAddress, asyncio.Task[Connection]] = {}
        self._links: dict[bytes, Link] = {}  # by the receiver's worker address
        self._in_flight: set[str] = set()
        self._prepared: dict[str, Connection] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._stream: torch.cuda.Stream | None = None  # message-path gathers (GPU pools)
        # Prepared requests, named to their receivers until sent, so their waits outlast the prefill.
        self._alive = KeepAlive(config.keepalive_interval_s, self._keep_alive)
        self._fault: TransferFault | None = None  # a test's (faults.py), for its next transfers
        self._faults_left = 0
        self.faults_hit = 0  # transfers the injected faults broke so far

    def inject(self, fault: TransferFault | None) -> None:
        """Test seam (faults.py): break the next `fault.times` transfers over UCX messages
        as `fault` says; None withdraws what is left of an earlier one."""
        self._fault = fault
        self._faults_left = 0 if fault is None else fault.times

    def _take_fault(self) -> TransferFault | None:
        if self._faults_left < 1:
            return None
        self._faults_left -= 1
        self.faults_hit += 1
        return self._fault

    @property
    def num_connections(self) -> int:
        return len(self._conns)

    def direct_peers(self) -> list[PeerAddress]:
        """Receivers this sender writes into directly (their pools mapped here)."""
        return [peer for peer, conn in self._conns.items() if conn.peer_kv is not None]

    def prepare(self, request_id: str, peer: PeerAddress) -> None:
        """See KVSender.prepare: asks a direct-write peer for its blocks now, or starts connecting;
        keeps the receiver's wait for `request_id` alive until it is sent or forgotten."""
        self._alive.add(request_id, peer)
        conn = self._conns.get(peer)
        if conn is None:
            spawn(self._connect_ahead(peer), self._tasks)
        elif conn.peer_kv is not None and not conn.closed and request_id not in self._prepared:
            conn.request_grant(request_id)
            self._prepared[request_id] = conn

    def forget(self, request_id: str) -> None:
        self._alive.discard(request_id)
        conn = self._prepared.pop(request_id, None)
        if conn is not None:
            conn.withdraw(request_id)

    async def _keep_alive(self, peer: PeerAddress, request_ids: list[str]) -> None:
        conn = self._conns.get(peer)
        if conn is not None:  # still connecting: the receiver's bound outlasts the connect timeout
            await conn.keep_alive(request_ids)

    async def _connect_ahead(self, peer: PeerAddress) -> None:
        with contextlib.suppress(TransferError):  # send() reports it
            await self._connection(peer)

    async def send(
        self, request_id: str, block_ids: Sequence[int], peer: PeerAddress, after: torch.cuda.Event | None = None
    ) -> TransferResult:
        ids = check_block_ids(block_ids, self._pool.num_blocks)
        if request_id in self._in_flight:
            raise ValueError(f"request {request_id!r} is already being sent")
        self._prepared.pop(request_id, None)  # the write below takes the grant, or sends it back
        self._in_flight.add(request_id)
        started = time.perf_counter()
        timeout = self._config.transfer_timeout_s
        attempt = _Attempt()
        try:
            # asyncio.timeout, not wait_for: the send runs in this task, no extra loop iteration.
            async with asyncio.timeout(timeout):
                error = await self._send(request_id, ids, peer, attempt, after)
        except TimeoutError:
            error = TransferTimeout(f"request {request_id!r} to {peer}: not landed within {timeout}s")
            if attempt.conn is not None and attempt.conn.data_in_flight(request_id):
                # The receiver stopped draining: nothing else on this link will get through.
                attempt.conn.close(TransferTimeout(f"{peer} stopped receiving"))
        except TransferError as e:
            error = e
        finally:
            self._in_flight.discard(request_id)
            self._alive.discard(request_id)
        transport = attempt.conn.transport if attempt.conn is not None else "unknown"
        direct = attempt.conn is not None and attempt.conn.peer_kv is not None
        return TransferResult(request_id, ids.numel() * self._bytes_per_block, transport,
                              time.perf_counter() - started, error, direct)

    async def close(self) -> None:
        self._prepared.clear()
        self._alive.close()
        for task in (*self._connecting.values(), *self._tasks):
            task.cancel()
        links, self._links = self._links, {}
        retiring = [link.retire([c.control for c in self._conns.values() if c.peer.worker_address == address],
                                self._config.connect_timeout_s) for address, link in links.items()]
        for conn in list(self._conns.values()):
            conn.close(TransferCancelled("sender closed"))
        await asyncio.gather(*retiring, return_exceptions=True)

    async def _send(
        self, request_id: str, ids: torch.Tensor, peer: PeerAddress, attempt: _Attempt, after: torch.cuda.Event | None
    ) -> TransferError | None:
        conn = attempt.conn = await self._connection(peer)
        if ids.numel() > conn.peer_num_blocks:
            return TransferRejected(f"request {request_id!r}: {ids.numel()} blocks, {peer} has {conn.peer_num_blocks}")
        if conn.peer_kv is not None:
            return await conn.write(request_id, ids, after)
        return await conn.transfer(request_id, await self._gather(ids, after), self._take_fault())

    async def _gather(self, ids: torch.Tensor, after: torch.cuda.Event | None) -> torch.Tensor:
        """The blocks packed for one UCX message. On a GPU on a stream of our own behind
        `after`, awaited off the loop: UCX reads the buffer outside torch's stream order, and
        neither the loop nor the gather waits for the engine's later steps."""
        if not self._pool.is_cuda:
            return self._pool.gather(ids)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self._pool.device)
        with torch.cuda.stream(self._stream):
            if after is not None:
                self._stream.wait_event(after)
            staging = self._pool.gather(ids)
            gathered = torch.cuda.Event()
            gathered.record(self._stream)
        await asyncio.to_thread(gathered.synchronize)
        return staging

    async def _connection(self, peer: PeerAddress) -> Connection:
        conn = self._conns.get(peer)
        if conn is not None:
            return conn
        task = self._connecting.get(peer)
        if task is None:
            task = asyncio.create_task(self._connect_within_timeout(peer))
            self._connecting[peer] = task
            task.add_done_callback(lambda t: self._connect_done(peer, t))
        try:
            # Shielded: one caller timing out must not abort a connect others wait on.
            conn = await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled():  # close() stopped the connect, not our caller
                raise TransferCancelled(f"sender closed while connecting to {peer}") from None
            raise
        if not conn.closed:  # it may have died already; the caller's transfer then reports why
            self._conns[peer] = conn
        return conn

    def _connect_done(self, peer: PeerAddress, task: asyncio.Task[Connection]) -> None:
        self._connecting.pop(peer, None)
        if not task.cancelled():
            task.exception()  # mark retrieved: every caller may have timed out already

    async def _connect_within_timeout(self, peer: PeerAddress) -> Connection:
        try:
            return await asyncio.wait_for(self._connect(peer), self._config.connect_timeout_s)
        except asyncio.TimeoutError:
            raise TransferTimeout(f"connecting to {peer} took over {self._config.connect_timeout_s}s") from None

    async def _link(self, peer: PeerAddress) -> Link:
        link = self._links.get(peer.worker_address)
        if link is not None:
            return link
        if not hmac.compare_digest(prove_address(self._config.secret, peer.worker_address), peer.proof):
            raise HandshakeRefused(f"{peer} failed to prove the cluster secret (different secrets?)")
        try:
            # Error handling on: the receiver's death fails the receives posted on it.
            link = await Link.open(peer.worker_address)
        except Exception as e:  # noqa: BLE001 - an address that does not unpack, unreachable
            raise PeerLost(f"cannot connect to {peer}: {e}") from e
        self._links[peer.worker_address] = link
        return link

    async def _connect(self, peer: PeerAddress) -> Connection:
        link = await self._link(peer)
        ctl = Control(link.ep, new_connection_id(), initiator=True)
        try:
            session = await client_handshake(ctl, link.sn, self._fields, self._config, str(peer), peer.incarnation)
            peer_kv = self._open_peer_pool(session, peer)
            probed = await self._probe(link.ep, session)
            # Direct writes: KV goes straight into the mapped pool; the probe only completes the handshake.
            transport = "cuda_ipc" if peer_kv is not None else probed
            if not self._config.allows(transport):
                reason = f"transport to {peer} is {transport}, allowed: {sorted(self._config.transports)}"
                await ctl.send({"t": "refuse", "reason": reason})
                raise SlowPathRefused(reason)
        except (HandshakeRefused, PeerReplaced, SlowPathRefused):
            raise  # said and done: nothing of this connection is left in flight on the link
        except BaseException as e:
            # Lost, timed out or cancelled mid-way: a receive may still be posted on the link.
            self._close_link(peer.worker_address, f"handshake with {peer} failed: {e!r}")
            if isinstance(e, Exception) and not isinstance(e, TransferError):
                raise PeerLost(f"handshake with {peer} failed: {e}") from e
            raise
        log = logger.warning if transport == "unknown" else logger.info
        path = "direct writes into the peer's pool" if peer_kv is not None else "UCX messages"
        log("KV transport to %s: %s (%s)", peer, transport, path)
        return Connection(peer, ctl, session, transport, self._forget, self._pool.single, peer_kv)

    def _open_peer_pool(self, session: Session, peer: PeerAddress) -> torch.Tensor | None:
        """The receiver's pool mapped for direct writes, or None (not offered, or not mappable here)."""
        desc, kv = session.peer_pool, self._pool.single
        if desc is None or kv is None or not (self._config.direct_writes and kv.is_cuda):
            return None  # (a tensor-parallel worker's ranks send by messages)
        try:
            peer_kv = open_pool(desc, kv.device)
        except ValueError as e:  # another host: messages are the path there
            logger.info("KV pool of %s not mappable here (%s): using UCX messages", peer, e)
            return None
        except RuntimeError as e:  # same host, yet CUDA or /dev/shm refused: a slower path than expected
            logger.warning("KV pool of %s offered but not mappable (%s): falling back to UCX messages", peer, e)
            return None
        expected = (*kv.shape[:2], session.peer_num_blocks, *kv.shape[3:])
        if tuple(peer_kv.shape) != expected or peer_kv.dtype != kv.dtype:
            raise TransferError(f"{peer} shared a pool of shape {tuple(peer_kv.shape)}, expected {expected}")
        return peer_kv

    def _forget(self, conn: Connection) -> None:
        if self._conns.get(conn.peer) is conn:
            del self._conns[conn.peer]
        self._close_link(conn.peer.worker_address, str(conn.error))

    def _close_link(self, worker_address: bytes, why: str) -> None:
        """Close the link to a receiver's worker, and every connection over it. The next
        connection to it opens another link (in step with the receiver's: see Link)."""
        link = self._links.pop(worker_address, None)
        if link is None:
            return
        for conn in [c for c in self._conns.values() if c.peer.worker_address == worker_address]:
            conn.close(PeerLost(f"{conn.peer}: link closed ({why})"))
        link.abort()

    async def _probe(self, ep: Any, session: Session) -> str:
        """Send one bulk-sized message so UCX wires up the data path, then read which transport it chose."""
        probe = torch.zeros(PROBE_BYTES, dtype=torch.uint8, device=self._pool.device)
        await ucx_io(ep.send(as_bytes(probe), tag=data_tag(session.key, PROBE_ID), force_tag=True))
        memory = "cuda" if self._pool.is_cuda else "host"
        return transport_from_ep_info(ep_info(ep.ucp_endpoint), memory)
