"""In-process KV transport with the UCX transport's semantics, for tests above it.

Same handshake checks (layout fingerprint, secret proof), same receive table (data
before or after expect, timeouts, cancellation), no network.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import torch

from pdserve.engine.kv.pool import KVLayout
from pdserve.kv_transport.api import (
    HandshakeRefused,
    PeerAddress,
    PeerLost,
    TransferError,
    TransferResult,
    TransferTimeout,
)
from pdserve.kv_transport.config import TransportConfig
from pdserve.kv_transport.handshake import check_proof, describe_mismatch, fingerprint, layout_fields, new_nonce, prove
from pdserve.kv_transport.keepalive import KeepAlive
from pdserve.kv_transport.receive_table import Ack, ReceiveTable
from pdserve.kv_transport.shards import PoolShards
from pdserve.kv_transport.staging import check_block_ids

TRANSPORT = "loopback"


class LoopbackNetwork:
    """Where loopback receivers are found by address."""

    def __init__(self) -> None:
        self._receivers: dict[PeerAddress, LoopbackReceiver] = {}

    def receiver(self, kv: torch.Tensor | PoolShards, layout: KVLayout, config: TransportConfig) -> LoopbackReceiver:
        address = PeerAddress("loopback", f"receiver-{len(self._receivers) + 1}".encode())
        receiver = LoopbackReceiver(self, address, kv, layout, config)
        self._receivers[address] = receiver
        return receiver

    def sender(self, kv: torch.Tensor | PoolShards, layout: KVLayout, config: TransportConfig) -> LoopbackSender:
        return LoopbackSender(self, kv, layout, config)

    def lookup(self, address: PeerAddress) -> LoopbackReceiver | None:
        return self._receivers.get(address)

    def remove(self, address: PeerAddress) -> None:
        self._receivers.pop(address, None)


class LoopbackReceiver:
    """KVReceiver over a LoopbackNetwork. Create with `LoopbackNetwork.receiver`."""

    def __init__(
        self, network: LoopbackNetwork, address: PeerAddress, kv: torch.Tensor | PoolShards, layout: KVLayout,
        config: TransportConfig,
    ) -> None:
        self._network = network
        self._address = address
        self._kv = PoolShards.of(kv)
        self._config = config
        self.fields = layout_fields(layout)
        self._table = ReceiveTable(self._kv, config.transfer_timeout_s)

    @property
    def address(self) -> PeerAddress:
        return self._address

    @property
    def num_pending(self) -> int:
        return self._table.num_pending

    def expect(self, request_id: str, block_ids: Sequence[int]) -> asyncio.Future[TransferResult]:
        return self._table.expect(request_id, block_ids)

    def cancel(self, request_id: str) -> None:
        self._table.cancel(request_id)

    async def close(self) -> None:
        self._network.remove(self._address)
        self._table.close()

    def server_proof(self, client_nonce: bytes, server_nonce: bytes, fp: str) -> str:
        return prove(self._config.secret, "server", client_nonce, server_nonce, fp)

    def touch(self, request_ids: list[str]) -> None:
        self._table.touch(request_ids)

    def deliver(self, request_id: str, staging: torch.Tensor, ack: Ack) -> None:
        self._table.landed(request_id, staging.to(self._kv.device), TRANSPORT, ack)


class LoopbackSender:
    """KVSender over a LoopbackNetwork. Create with `LoopbackNetwork.sender`."""

    def __init__(self, network: LoopbackNetwork, kv: torch.Tensor | PoolShards, layout: KVLayout,
                 config: TransportConfig) -> None:
        self._network = network
        self._kv = PoolShards.of(kv)
        self._config = config
        self._fields = layout_fields(layout)
        self._bytes_per_block = self._kv.bytes_per_block
        self._in_flight: set[str] = set()
        self._alive = KeepAlive(config.keepalive_interval_s, self._keep_alive)

    async def send(
        self, request_id: str, block_ids: Sequence[int], peer: PeerAddress, after: torch.cuda.Event | None = None
    ) -> TransferResult:
        ids = check_block_ids(block_ids, self._kv.num_blocks)
        if request_id in self._in_flight:
            raise ValueError(f"request {request_id!r} is already being sent")
        if after is not None:
            after.synchronize()  # in-process test double: plain torch copies follow
        started = time.perf_counter()
        self._in_flight.add(request_id)
        try:
            error = await self._send(request_id, ids, peer)
        finally:
            self._in_flight.discard(request_id)
            self._alive.discard(request_id)
        return TransferResult(
            request_id, ids.numel() * self._bytes_per_block, TRANSPORT, time.perf_counter() - started, error
        )

    def prepare(self, request_id: str, peer: PeerAddress) -> None:
        """Nothing to connect in one process; keeps the receiver's wait alive, as UCX's does."""
        self._alive.add(request_id, peer)

    def forget(self, request_id: str) -> None:
        self._alive.discard(request_id)

    async def close(self) -> None:
        """Loopback holds no connections; the keep-alive stops."""
        self._alive.close()

    async def _keep_alive(self, peer: PeerAddress, request_ids: list[str]) -> None:
        receiver = self._network.lookup(peer)
        if receiver is not None:
            receiver.touch(request_ids)

    async def _send(self, request_id: str, ids: torch.Tensor, peer: PeerAddress) -> TransferError | None:
        receiver = self._network.lookup(peer)
        if receiver is None:
            return PeerLost(f"no loopback receiver at {peer}")
        mismatch = describe_mismatch(self._fields, receiver.fields)
        if mismatch:
            return HandshakeRefused(f"KV layout mismatch with {peer}: {mismatch}")
        client_nonce, server_nonce, fp = new_nonce(), new_nonce(), fingerprint(self._fields)
        proof = receiver.server_proof(client_nonce, server_nonce, fp)
        if not check_proof(self._config.secret, "server", client_nonce, server_nonce, fp, proof):
            return HandshakeRefused(f"{peer} failed to prove the cluster secret")
        acked: asyncio.Future[TransferError | None] = asyncio.get_running_loop().create_future()

        def ack(error: TransferError | None) -> None:
            if not acked.done():
                acked.set_result(error)

        staging = self._kv.gather(ids)
        if staging.is_cuda:
            torch.cuda.current_stream(staging.device).synchronize()  # in-process test double: plainly in order
        receiver.deliver(request_id, staging, ack)
        try:
            return await asyncio.wait_for(acked, self._config.transfer_timeout_s)
        except asyncio.TimeoutError:
            return TransferTimeout(f"request {request_id!r}: no answer from {peer} within the timeout")
