"""UCX plumbing shared by the UCX sender and receiver: process setup, control
messages and the authenticated handshake.

Every connection has a control endpoint (listener-made, UCX error handling on, so
a dead peer fails its pending receives) carrying small JSON frames, one UCX
message each, so that concurrent senders never interleave.
"""

from __future__ import annotations

import asyncio
import json
import logging
import struct
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import ucxx

from pdserve.kv_transport.api import HandshakeRefused, PeerReplaced
from pdserve.kv_transport.config import TransportConfig
from pdserve.kv_transport.handshake import check_proof, describe_mismatch, fingerprint, new_nonce, prove

logger = logging.getLogger(__name__)

MAX_FRAME_BYTES = 256 << 10  # RDMA worker addresses run to kilobytes; grants list up to ~48k block ids
_LEN = struct.Struct("<I")
PROBE_BYTES = 64 << 10  # above UCX's rendezvous threshold, so the probe picks the bulk path
PROBE_ID = "\x00probe"


def ensure_ucx(config: TransportConfig) -> None:
    """Initialise ucxx for this process and its running event loop, with the configured
    progress mode. A worker whose address is loopback (a local cluster) keeps UCX's network
    transports on the loopback device, so that their sockets (UCX's TCP transport listens on
    every device it uses) stay off other interfaces.

    Thread mode completes asyncio futures from ucxx's notifier thread: nothing polls while a
    receive waits (blocking mode awaits every pending operation by yielding to the loop
    round after round: one core spent for good once a connection exists, measured 90-95%
    per idle worker). Those futures belong to the loop ucxx was initialised under, so a
    process that moves on to another loop (a script of several asyncio.run calls) starts
    ucxx afresh there, once the old loop is closed."""
    loop = asyncio.get_running_loop()
    if _UCX.loop is loop:
        return
    if _UCX.loop is not None:
        if not _UCX.loop.is_closed():
            raise RuntimeError("ucxx is already bound to another running event loop of this process")
        ucxx.reset()
    # UCX warns about ucxx's own UCX_MEMTYPE_CACHE setting on every start.
    options = {"WARN_UNUSED_ENV_VARS": "n"}
    if config.is_loopback:
        options["NET_DEVICES"] = LOOPBACK_DEVICE
    ucxx.init(options=options, progress_mode=config.progress_mode,
              enable_python_future=config.progress_mode == "thread")
    _UCX.loop = loop


@dataclass(slots=True)
class _UcxState:
    """ucxx is initialised once per process (its context is global): the loop it serves."""

    loop: asyncio.AbstractEventLoop | None = None


_UCX = _UcxState()


LOOPBACK_DEVICE = "lo"  # Linux's name for it
T = TypeVar("T")


def spawn(coro: Coroutine[Any, Any, None], tasks: set[asyncio.Task[None]]) -> None:
    """Run a fire-and-forget frame send, tracked in `tasks` so that close() can cancel it.

    Its failure is only logged: a broken link is noticed and handled by the reader loop.
    """
    task = asyncio.ensure_future(coro)
    tasks.add(task)

    def done(t: asyncio.Task[None]) -> None:
        tasks.discard(t)
        if not t.cancelled() and t.exception() is not None:
            logger.debug("control frame not sent: %s", t.exception())

    task.add_done_callback(done)


class UcxIOError(Exception):
    """A ucxx send, receive or connect failed; the message names UCX's error."""


async def ucx_io(operation: Awaitable[T]) -> T:
    """Await one ucxx operation. In thread progress mode ucxx keeps a failed operation's
    exception (in its pool of futures), and with it the exception's traceback: every frame it
    passed, ours and the endpoints they hold included, for good. So a failure is raised as a
    fresh UcxIOError, the original's traceback dropped."""
    try:
        return await operation
    except Exception as e:  # noqa: BLE001 - UCX reports a dead peer as assorted errors
        message = f"{type(e).__name__}: {e}"
        e.__traceback__ = None
        raise UcxIOError(message) from None


class Control:
    """Framed JSON messages over a ucxx endpoint (the connection's default tags)."""

    def __init__(self, ep: Any) -> None:
        self.ep = ep

    async def send(self, msg: dict[str, Any]) -> None:
        payload = json.dumps(msg).encode()
        if len(payload) + _LEN.size > MAX_FRAME_BYTES:
            raise ValueError(f"control frame too large ({len(payload)} bytes)")
        await ucx_io(self.ep.send(np.frombuffer(_LEN.pack(len(payload)) + payload, np.uint8)))

    async def recv(self) -> dict[str, Any]:
        buf = np.empty(MAX_FRAME_BYTES, np.uint8)
        await ucx_io(self.ep.recv(buf))
        (length,) = _LEN.unpack_from(buf)
        msg = json.loads(buf[_LEN.size:_LEN.size + length].tobytes())
        if not isinstance(msg, dict) or "t" not in msg:
            raise ValueError("malformed control frame")
        return msg

    async def expect(self, kind: str) -> dict[str, Any]:
        """Next frame, which must be `kind`; a 'refuse' frame raises HandshakeRefused."""
        msg = await self.recv()
        if msg["t"] == "refuse":
            raise HandshakeRefused(f"peer refused: {msg.get('reason', '?')}")
        if msg["t"] != kind:
            raise HandshakeRefused(f"protocol error: expected {kind!r}, got {msg['t']!r}")
        return msg

    def abort(self) -> None:
        # A short close period: a dead peer must not hold the event loop for UCX's 10 s default.
        self.ep.abort(period=10**8)


@dataclass(frozen=True, slots=True)
class Session:
    """What an accepted handshake established."""

    key: bytes  # client nonce + server nonce: seeds per-request data tags
    peer_num_blocks: int
    peer_worker_address: bytes
    peer_pool: dict[str, Any] | None = None  # the receiver's pool as a CUDA IPC handle (cuda_ipc.export_pool)


async def client_handshake(
    ctl: Control, fields: dict[str, str | int], config: TransportConfig, where: str, incarnation: str = "",
) -> Session:
    """Sender side. Raises HandshakeRefused, or PeerReplaced when the receiver is not the
    `incarnation` we address ("" takes any), after telling the peer why."""
    client_nonce = new_nonce()
    await ctl.send({"t": "hello", "layout": fields, "nonce": client_nonce.hex()})
    challenge = await ctl.expect("challenge")
    server_nonce, server_fields = bytes.fromhex(challenge["nonce"]), challenge["layout"]
    reason = ""
    if not check_proof(config.secret, "server", client_nonce, server_nonce, fingerprint(server_fields),
                       challenge["proof"]):
        reason = f"{where} failed to prove the cluster secret (different secrets?)"
    elif mismatch := describe_mismatch(fields, server_fields):
        reason = f"KV layout mismatch with {where}: {mismatch}"
    if reason:
        await ctl.send({"t": "refuse", "reason": reason})
        raise HandshakeRefused(reason)
    if incarnation and challenge.get("incarnation") != incarnation:
        reason = f"{where} is incarnation {challenge.get('incarnation')!r}, not {incarnation!r}: it was replaced"
        await ctl.send({"t": "refuse", "reason": reason})
        raise PeerReplaced(reason)
    proof = prove(config.secret, "client", client_nonce, server_nonce, fingerprint(fields))
    await ctl.send({"t": "auth", "proof": proof})
    accept = await ctl.expect("accept")
    return Session(client_nonce + server_nonce, int(accept["num_blocks"]), bytes.fromhex(accept["worker_address"]),
                   accept.get("pool"))


async def server_handshake(
    ctl: Control, fields: dict[str, str | int], config: TransportConfig, num_blocks: int,
    pool: Callable[[], dict[str, Any] | None], incarnation: str = "",
) -> Session:
    """Receiver side. Raises HandshakeRefused (after telling the peer why).

    `pool` describes the receiver's pool for direct writes (None: not offered); it is
    called, and its handle sent, only once the sender has proved the secret.
    """
    hello = await ctl.expect("hello")
    client_nonce, client_fields = bytes.fromhex(hello["nonce"]), hello["layout"]
    server_nonce = new_nonce()
    proof = prove(config.secret, "server", client_nonce, server_nonce, fingerprint(fields))
    await ctl.send({"t": "challenge", "layout": fields, "nonce": server_nonce.hex(), "proof": proof,
                    "incarnation": incarnation})
    auth = await ctl.expect("auth")
    reason = ""
    if not check_proof(config.secret, "client", client_nonce, server_nonce, fingerprint(client_fields),
                       auth["proof"]):
        reason = "sender failed to prove the cluster secret (different secrets?)"
    elif mismatch := describe_mismatch(fields, client_fields):
        reason = f"KV layout mismatch: {mismatch}"
    if reason:
        await ctl.send({"t": "refuse", "reason": reason})
        raise HandshakeRefused(reason)
    # The worker address and the pool handle open the fast data paths; only authenticated peers get them.
    address = bytes(ucxx.get_worker_address())
    await ctl.send({"t": "accept", "num_blocks": num_blocks, "worker_address": address.hex(), "pool": pool()})
    return Session(client_nonce + server_nonce, 0, b"")
