"""A KV sender or receiver in its own process, driven over a multiprocessing pipe.

The UCX process tests spawn these so that both sides are real processes with real
UCX, and so that one side can be SIGKILLed mid-transfer.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import json
import os
import threading
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch
import ucxx

from pdserve.engine.kv.pool import KVLayout, KVPool
from pdserve.kv_transport import PeerAddress, TransferResult, TransportConfig, release_on_failure
from pdserve.kv_transport.faults import TransferFault
from pdserve.kv_transport.handshake import HELLO_TAG
from pdserve.kv_transport.ucx_connection import Connection as UcxConnection
from pdserve.kv_transport.ucx_link import MAX_FRAME_BYTES, stop_ucx
from pdserve.kv_transport.ucx_receiver import UcxKVReceiver
from pdserve.kv_transport.ucx_sender import UcxKVSender


@dataclass(frozen=True)
class PeerSpec:
    """What a child builds: its pool, layout and transport config."""

    secret: bytes = b"pdserve-test-secret"
    model: str = "tiny"
    head_dim: int = 8
    num_blocks: int = 64
    timeout_s: float = 5.0
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # more TransportConfig fields
    # Direct writes: the receiver's pool lives in a shared file that the sender maps, standing
    # in for the CUDA IPC mapping (CPU-only CI); the wire protocol and the copy are the real ones.
    direct: bool = False
    device: str = "cpu"  # the pool's; on a GPU the real CUDA IPC mapping serves direct writes
    dtype: torch.dtype = torch.float16  # the pool's (float8_e4m3fn: an FP8 cache)
    wire_layout: KVLayout | None = None  # a real worker's (a stranger that passes its handshake), else the above

    def layout(self) -> KVLayout:
        if self.wire_layout is not None:
            return self.wire_layout
        return KVLayout(self.model, self.dtype, num_layers=2, num_kv_heads=2, head_dim=self.head_dim, block_size=4)

    def config(self) -> TransportConfig:
        return TransportConfig(secret=self.secret, transfer_timeout_s=self.timeout_s, connect_timeout_s=self.timeout_s,
                               **self.extra)

    def with_(self, **changes: Any) -> PeerSpec:
        return replace(self, **changes)


def digest(kv: torch.Tensor, block_ids: list[int]) -> str:
    """sha256 of blocks `block_ids` (all layers, K and V, in order) of a pool."""
    return hashlib.sha256(kv[:, :, block_ids].cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def run_peer(role: str, conn: Connection, spec: PeerSpec) -> None:
    """Child process entry point."""
    if spec.direct:
        _map_pools_through_files()
    asyncio.run(_Peer(role, conn, spec).run())


def _map_pools_through_files() -> None:
    """Stand-ins for cuda_ipc.export_pool / open_pool on CPU pools: a file in /dev/shm."""

    def offer(receiver: UcxKVReceiver) -> dict[str, Any]:
        kv = receiver._kv.single
        assert kv is not None
        path = f"/dev/shm/pdserve-test-{os.getpid()}-{id(kv)}"
        if not os.path.exists(path):
            shared = torch.from_file(path, shared=True, size=kv.numel(), dtype=kv.dtype).view(kv.shape)
            shared.copy_(kv)
            kv.set_(shared)  # the receiver's pool now lives in the file (same tensor object)
        return {"path": path, "shape": list(kv.shape)}

    def open_(sender: UcxKVSender, session: Any, peer: Any) -> torch.Tensor | None:
        desc = session.peer_pool
        if desc is None:
            return None
        shape = torch.Size(desc["shape"])
        dtype = sender._pool.single.dtype
        return torch.from_file(desc["path"], shared=True, size=shape.numel(), dtype=dtype).view(shape)

    UcxKVReceiver._offer_pool = offer  # type: ignore[method-assign]
    UcxKVSender._open_peer_pool = open_  # type: ignore[method-assign]


class _Peer:
    def __init__(self, role: str, conn: Connection, spec: PeerSpec) -> None:
        self.role = role
        self.conn = conn
        self.spec = spec
        self.pool = KVPool(spec.layout(), spec.num_blocks, spec.device)
        self.held: set[int] = set()  # blocks "the caller" holds until a transfer ends
        self.stalling = 0  # handshakes held up by a "stall" command, not yet let go
        self.landed: set[int] = set()
        self.tasks: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        if self.role in ("sender", "stranger"):
            torch.manual_seed(self.spec.seed)
            self.pool.kv.copy_(torch.randn(self.pool.kv.shape).to(self.pool.kv.dtype))
            self.peer: Any = UcxKVSender(self.pool.kv, self.spec.layout(), self.spec.config())
        else:
            self.peer = await UcxKVReceiver.start(self.pool.kv, self.spec.layout(), self.spec.config())
        inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        # A reader on the pipe, not a thread: the tests count threads.
        asyncio.get_running_loop().add_reader(self.conn.fileno(), lambda: inbox.put_nowait(self.conn.recv()))
        address = self.peer.address if self.role == "receiver" else None
        self.conn.send({"op": "ready", "address": address})
        while (cmd := await inbox.get())["op"] != "exit":
            for request_id in cmd.get("prepare", []):
                self.peer.prepare(request_id, cmd["peer"])
            for request_id in cmd.get("forget", []):
                self.peer.forget(request_id)
            for request_id, block_ids in cmd.get("requests", []):
                self.held.update(block_ids)
                if cmd["op"] == "expect":
                    self._spawn(request_id, block_ids, self.peer.expect(request_id, block_ids))
                else:
                    self._spawn(request_id, block_ids, self.peer.send(request_id, block_ids, cmd["peer"]))
            if cmd["op"] == "stats":
                self.conn.send({"op": "stats", **self._stats()})
            if cmd["op"] == "garbage":
                await self._send_garbage(cmd["peer"])
                self.conn.send({"op": "garbage"})
            if cmd["op"] == "drop":  # the receiver closes every connection, as on a sender's protocol break
                for connection in list(self.peer._conns):
                    connection.close()
            if cmd["op"] == "stall":
                self._stall_handshakes(cmd["where"], cmd["count"])
            if cmd["op"] == "announce":  # the sender tells the test when it posts a request's data
                self._announce_data()
            if cmd["op"] == "fault":  # the sender breaks its next transfers (kv_transport/faults.py)
                self.peer.inject(TransferFault(**cmd["fault"]))
            if cmd["op"] == "malformed":
                self.conn.send({"op": "malformed", "errors": await self._send_malformed(cmd["peer"], cmd["frames"])})
        await self.peer.close()
        stop_ucx()  # or the process waits at its exit for ucxx's notifier thread

    async def _send_garbage(self, peer: PeerAddress) -> None:
        """Unauthenticated and malformed traffic on the receiver's hello tag: bytes that are
        no frame, a frame longer than its message, an oversized message, hellos whose worker
        address would not unpack (UCX asserts on some: it must never be unpacked unproven),
        with a wrong proof or none, and one with a real address but no proof."""

        def frame(msg: dict[str, Any]) -> bytes:
            payload = json.dumps(msg).encode()
            return len(payload).to_bytes(4, "little") + payload

        own = bytes(ucxx.get_worker_address()).hex()
        frames = [b"not a frame", (1 << 20).to_bytes(4, "little") + b"{}", bytes(MAX_FRAME_BYTES + 1),
                  frame({"t": "hello", "conn": "00" * 8, "worker_address": "ff" * 64}),
                  frame({"t": "hello", "conn": "22" * 8, "worker_address": "ff" * 64, "nonce": "00" * 16,
                         "layout": {}, "proof": "00" * 32}),
                  frame({"t": "hello", "conn": "11" * 8, "worker_address": own})]
        address = ucxx.get_ucx_address_from_buffer(peer.worker_address)
        ep = await ucxx.create_endpoint_from_worker_address(address, endpoint_error_handling=True)
        for data in frames:
            await ep.send(np.frombuffer(data, np.uint8), tag=HELLO_TAG, force_tag=True)

    async def _send_malformed(self, peer: PeerAddress, frames: list[dict[str, Any] | bytes]) -> list[str]:
        """Each of `frames` over an authenticated connection of its own (a dict: a well-formed
        frame of bad content; bytes: a frame as they are, e.g. cut short): how the connection
        ended, as "ErrorClass: message" (or "open" if the receiver let it be)."""
        errors = []
        for frame in frames:
            conn = await self.peer._connection(peer)
            if isinstance(frame, dict):
                await conn.control.send(frame)
            else:
                await conn.control.ep.send(np.frombuffer(frame, np.uint8), tag=conn.control._send_tag, force_tag=True)
            for _ in range(100):
                if conn.closed:
                    break
                await asyncio.sleep(0.05)
            errors.append(f"{type(conn.error).__name__}: {conn.error}" if conn.closed else "open")
        return errors

    def _stall_handshakes(self, where: str, count: int) -> None:
        """The receiver's next `count` handshakes hang past the connect timeout, as in a
        receiver whose event loop is held up: before it makes its endpoints back to the sender
        ("hello": it never makes that link's endpoints), or just after ("link")."""
        receiver, left = self.peer, [count]
        link_for = receiver._link_for

        async def stalled(hello: Any) -> Any:
            link = await link_for(hello) if where == "link" else None
            if left[0] > 0:
                left[0] -= 1
                self.stalling += 1
                try:
                    await asyncio.sleep(2 * self.spec.timeout_s)
                finally:
                    self.stalling -= 1
            return link if link is not None else await link_for(hello)

        receiver._link_for = stalled

    def _announce_data(self) -> None:
        """From now on a "posting" message reaches the test as each request's KV, gathered,
        is handed to UCX: the message is on its way to the receiver right after."""
        send_data, conn = UcxConnection._send_data, self.conn

        async def announced(connection: UcxConnection, request_id: str, payload: Any) -> None:
            conn.send({"op": "posting", "id": request_id})
            await send_data(connection, request_id, payload)

        UcxConnection._send_data = announced  # type: ignore[method-assign]

    def _spawn(self, request_id: str, block_ids: list[int], transfer: Any) -> None:
        async def run() -> None:
            result = await release_on_failure(transfer, lambda: self.held.difference_update(block_ids))
            self._report(result, block_ids)

        task = asyncio.create_task(run())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _report(self, result: TransferResult, block_ids: list[int]) -> None:
        if result.ready is not None:
            result.ready.synchronize()  # a GPU copy may still be landing: the caller waits for it
        if result.ok:
            self.held.difference_update(block_ids)  # the test's caller is done with them
            self.landed.update(block_ids)
        self.conn.send({
            "op": "result", "id": result.request_id, "ok": result.ok, "transport": result.transport,
            "error": type(result.error).__name__ if result.error else None, "message": str(result.error or ""),
            "elapsed_s": result.elapsed_s, "num_bytes": result.num_bytes, "direct": result.direct,
            "digest": digest(self.pool.kv, block_ids) if result.ok else None,
        })

    def _stats(self) -> dict[str, Any]:
        gc.collect()
        untouched = [b for b in range(self.spec.num_blocks) if b not in self.landed]
        return {
            "threads": len(threading.enumerate()),
            "endpoints": sum(type(o) is ucxx._lib_async.endpoint.Endpoint for o in gc.get_objects()),
            "connections": self.peer.num_connections,
            "pending": getattr(self.peer, "num_pending", 0),
            "held": len(self.held),
            "tasks": len(self.tasks),
            "stalling": self.stalling,
            # A receiver's blocks start at zero: a non-zero block nobody sent to is a stray write.
            "stray_blocks": int((self.pool.kv[:, :, untouched] != 0).any(dim=(0, 1, 3, 4, 5)).sum())
            if self.role == "receiver" and untouched else 0,
        }
