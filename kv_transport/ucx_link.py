"""UCX plumbing shared by the UCX sender and receiver: process setup, control
messages and the authenticated handshake.

Nothing listens: a sender makes its control endpoint from the receiver's UCX worker
address (PeerAddress, passed through Ray) and sends its hello, with its own worker
address, a fresh connection id and a proof of the cluster secret over both, on HELLO_TAG,
which the receiver waits on at worker level; the receiver checks the proof, then makes
its endpoints back for the sender's link named in the hello (see Link). Both control
endpoints keep UCX error handling on, so that a dead peer fails the receives posted
on them. Control frames are small JSON, one tagged UCX message each, on tags derived from
the connection id (handshake.control_tags), so that concurrent senders never interleave.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import struct
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import ucxx

from pdserve.kv_transport.api import HandshakeRefused, PeerReplaced
from pdserve.kv_transport.config import TransportConfig
from pdserve.kv_transport.handshake import (
    CONNECTION_ID_BYTES,
    HELLO_TAG,
    check_proof,
    control_tags,
    describe_mismatch,
    fingerprint,
    new_nonce,
    prove,
    prove_hello,
)

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
    # UCX warns about ucxx's own UCX_MEMTYPE_CACHE setting on every start. A silent peer (a
    # host gone without closing its sockets) is found by UCX's keepalive rounds, 20 s apart
    # by default: KEEPALIVE_S. Shared memory's FIFOs (posix, sysv) are left without error
    # handling (UCX's default), so a Link never uses them: see Link.
    options = {"WARN_UNUSED_ENV_VARS": "n", "KEEPALIVE_INTERVAL": f"{KEEPALIVE_S}s"}
    if config.is_loopback:
        options["NET_DEVICES"] = LOOPBACK_DEVICE
    ucxx.init(options=options, progress_mode=config.progress_mode,
              enable_python_future=config.progress_mode == "thread")
    if config.progress_mode == "thread" and config.progress_wake_ms != 1:
        # ucxx starts its progress thread at init with a 1 ms epoll timeout: started again
        # with the configured one.
        worker = ucxx.core._get_ctx().worker
        worker.stop_progress_thread()
        worker.start_progress_thread(polling_mode=False, epoll_timeout=config.progress_wake_ms)
    _UCX.loop = loop
    _UCX.made.clear()  # a new ucxx context is a new UCX worker: its endpoint counts start again


def stop_ucx() -> None:
    """Stop ucxx's notifier thread, the last thing of UCX's in a process whose senders and
    receivers are closed. The thread is not a daemon: a process that exits normally (a test's
    peer, a benchmark) would otherwise wait for it at interpreter shutdown, forever (ucxx's
    own warning). Ray's workers never exit that way: they are killed."""
    if _UCX.loop is not None:
        ucxx.stop_notifier_thread()


@dataclass(slots=True)
class _UcxState:
    """ucxx is initialised once per process (its context is global): the loop it serves."""

    loop: asyncio.AbstractEventLoop | None = None
    # Endpoints this process's UCX worker has made to each peer worker (by its address), as
    # UCX numbers them (see Link).
    made: dict[bytes, int] = field(default_factory=dict)


_UCX = _UcxState()


LOOPBACK_DEVICE = "lo"  # Linux's name for it
# How often UCX checks that each peer lives: a peer that is gone without a word (a host off
# the network) fails its link within ~1 s, failing what is posted on it. (A dead process's
# sockets close at once: its links fail then.)
KEEPALIVE_S = 1
T = TypeVar("T")


def spawn(coro: Coroutine[Any, Any, None], tasks: set[asyncio.Task[None]]) -> asyncio.Task[None]:
    """Run a fire-and-forget frame send, tracked in `tasks` so that close() can cancel (or
    await) it.

    Its failure is only logged: a broken link is noticed and handled by the reader loop.
    """
    task = asyncio.ensure_future(coro)
    tasks.add(task)

    def done(t: asyncio.Task[None]) -> None:
        tasks.discard(t)
        if not t.cancelled() and t.exception() is not None:
            logger.debug("control frame not sent: %s", t.exception())

    task.add_done_callback(done)
    return task


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


def parse_frame(buf: np.ndarray) -> dict[str, Any]:
    """The JSON frame in a received buffer. Raises ValueError on anything else (a
    stranger's bytes, a frame that claims more than the buffer holds)."""
    (length,) = _LEN.unpack_from(buf)
    if length > buf.size - _LEN.size:
        raise ValueError("malformed control frame (length)")
    try:
        msg = json.loads(buf[_LEN.size:_LEN.size + length].tobytes())
    except UnicodeDecodeError as e:  # json.JSONDecodeError is a ValueError already
        raise ValueError(f"malformed control frame: {e}") from None
    if not isinstance(msg, dict) or "t" not in msg:
        raise ValueError("malformed control frame")
    return msg


def frame_buffer() -> np.ndarray:
    return np.empty(MAX_FRAME_BYTES, np.uint8)


class Control:
    """Framed JSON messages of one connection over a link's control endpoint, on the
    connection's tags.

    Receives are posted on the endpoint (tags match at worker level, whichever endpoint the
    peer sent by), so that its error or abort cancels them."""

    def __init__(self, ep: Any, connection_id: bytes, initiator: bool) -> None:
        self.ep = ep
        self.connection_id = connection_id
        to_receiver, to_sender = control_tags(connection_id)
        self._send_tag, self._recv_tag = (to_receiver, to_sender) if initiator else (to_sender, to_receiver)

    async def send(self, msg: dict[str, Any], tag: int | None = None) -> None:
        """One frame, on the connection's tag (or `tag`: the hello's)."""
        payload = json.dumps(msg).encode()
        if len(payload) + _LEN.size > MAX_FRAME_BYTES:
            raise ValueError(f"control frame too large ({len(payload)} bytes)")
        frame = np.frombuffer(_LEN.pack(len(payload)) + payload, np.uint8)
        await ucx_io(self.ep.send(frame, tag=self._send_tag if tag is None else tag, force_tag=True))

    async def recv(self) -> dict[str, Any]:
        buf = frame_buffer()
        await ucx_io(self.ep.recv(buf, tag=self._recv_tag, force_tag=True))
        return parse_frame(buf)

    async def expect(self, kind: str) -> dict[str, Any]:
        """Next frame, which must be `kind`; a 'refuse' frame raises HandshakeRefused."""
        msg = await self.recv()
        if msg["t"] == "closed":  # the link is gone at the other end: like a UCX error, not a verdict
            raise UcxIOError("the peer closed the connection")
        if msg["t"] == "refuse":
            raise HandshakeRefused(f"peer refused: {msg.get('reason', '?')}")
        if msg["t"] != kind:
            raise HandshakeRefused(f"protocol error: expected {kind!r}, got {msg['t']!r}")
        return msg


class Link:
    """The endpoint this process made to one peer worker, with UCX error handling on: the
    peer's death fails the sends and receives posted on it and the transfers in flight. UCX
    then picks cuda_ipc or RDMA for the bulk where there are, and TCP for the rest, never
    host shared memory on one host: posix/sysv FIFOs offer no error handling unless asked
    (`MM_ERROR_HANDLING`), and with it asked a sender killed mid-message left its receiver's
    FIFO stalled (no further hello or KV from anyone, seen 1 run in 4-6 of
    `test_sender_killed_mid_transfer` under load); without error handling, a cma read from a
    sender that had died aborted the receiving process (stop 60's CI). TCP on one host costs
    0-15% of a 4k-token transfer on the CPU machine (benchmarks/RESULTS.md).

    UCX numbers the endpoints each worker makes to a peer and pairs the n-th of one side
    with the n-th of the other; every link, on either side, is one endpoint, so either side
    may close a link while the other lives and open another, and the two stay in step. (A
    link paired with the remains of an older one still carries its frames: UCX matches tags
    at worker level.) `sn`, this process's count of endpoints to the peer when the link was
    made, names the link and orders it after the ones before: a sender's hello carries it,
    so that the receiver knows a new link from another connection over the one it holds.
    """

    def __init__(self, sn: int, ep: Any, answers: int) -> None:
        self.sn = sn
        self.ep = ep
        self.answers = answers  # a receiver's link: the `sn` of the sender's that it answers (else -1)

    @classmethod
    async def open(cls, worker_address: bytes, answers: int = -1) -> Link:
        """Raises UcxIOError (or ValueError-like errors of ucxx) for an address that does not unpack."""
        address = ucxx.get_ucx_address_from_buffer(worker_address)
        sn = _UCX.made.get(worker_address, 0)
        # Counted before the await: ucxx makes the endpoint in the coroutine's first step,
        # before any other task runs, so the count and UCX's own stay equal.
        _UCX.made[worker_address] = sn + 1
        ep = await ucx_io(ucxx.create_endpoint_from_worker_address(address, endpoint_error_handling=True))
        return cls(sn, ep, answers)

    def abort(self) -> None:
        # A short close period: a dead peer must not hold the event loop for UCX's 10 s default.
        self.ep.abort(period=10**8)

    async def retire(self, connections: Sequence[Control], bound_s: float) -> None:
        """Tell the peer over each of `connections` that it is closed, then abort. An endpoint
        made from a worker address closes silently: without the word, a live peer would go
        on sending into a link that nobody reads."""
        try:
            await asyncio.wait_for(asyncio.gather(*(c.send({"t": "closed"}) for c in connections),
                                                  return_exceptions=True), bound_s)
        except asyncio.TimeoutError:
            pass
        finally:
            self.abort()


@dataclass(frozen=True, slots=True)
class Session:
    """What an accepted handshake established."""

    key: bytes  # client nonce + server nonce: seeds per-request data tags
    peer_num_blocks: int
    peer_pool: dict[str, Any] | None = None  # the receiver's pool as a CUDA IPC handle (cuda_ipc.export_pool)


@dataclass(frozen=True, slots=True)
class Hello:
    """A sender's first frame as the receiver read it at worker level: who to answer, on
    which connection, and the rest of it for the handshake."""

    connection_id: bytes
    sn: int  # names the sender's link to us, and orders it (see Link)
    worker_address: bytes  # the sender's: the receiver's endpoint back is made from it
    frame: dict[str, Any]

    @classmethod
    def parse(cls, msg: dict[str, Any], secret: bytes) -> Hello:
        """Raises ValueError when `msg` is not a hello, or not one from a holder of `secret`
        (its worker address is unpacked only then: see handshake.prove_hello)."""
        if msg["t"] != "hello":
            raise ValueError(f"expected a hello, got {msg['t']!r}")
        try:
            nonce, connection_id = bytes.fromhex(msg["nonce"]), bytes.fromhex(msg["conn"])
            address, proof = bytes.fromhex(msg["worker_address"]), str(msg["proof"])
            fp, sn = fingerprint(msg["layout"]), msg["sn"]
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"malformed hello: {e!r}") from None
        if len(connection_id) != CONNECTION_ID_BYTES or not address:
            raise ValueError("malformed hello: connection id or worker address")
        if type(sn) is not int or sn < 0:
            raise ValueError(f"malformed hello: link {sn!r}")
        if not hmac.compare_digest(prove_hello(secret, nonce, connection_id, sn, address, fp), proof):
            raise ValueError("hello without a proof of the cluster secret (different secrets?)")
        return cls(connection_id, sn, address, msg)


async def client_handshake(
    ctl: Control, sn: int, fields: dict[str, str | int], config: TransportConfig, where: str, incarnation: str = "",
) -> Session:
    """Sender side: the hello (on HELLO_TAG, naming our worker address and the connection),
    then the challenge-response. Raises HandshakeRefused, or PeerReplaced when the receiver
    is not the `incarnation` we address ("" takes any), after telling the peer why."""
    client_nonce, address = new_nonce(), bytes(ucxx.get_worker_address())
    proof = prove_hello(config.secret, client_nonce, ctl.connection_id, sn, address, fingerprint(fields))
    await ctl.send({"t": "hello", "layout": fields, "nonce": client_nonce.hex(), "conn": ctl.connection_id.hex(),
                    "sn": sn, "worker_address": address.hex(), "proof": proof}, tag=HELLO_TAG)
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
    return Session(client_nonce + server_nonce, int(accept["num_blocks"]), accept.get("pool"))


async def server_handshake(
    ctl: Control, hello: Hello, fields: dict[str, str | int], config: TransportConfig, num_blocks: int,
    pool: Callable[[], dict[str, Any] | None], incarnation: str = "",
) -> Session:
    """Receiver side, from the sender's hello. Raises HandshakeRefused (after telling the peer why).

    `pool` describes the receiver's pool for direct writes (None: not offered); it is
    called, and its handle sent, only once the sender has proved the secret.
    """
    client_nonce, client_fields = bytes.fromhex(hello.frame["nonce"]), hello.frame["layout"]
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
    # The pool handle opens the direct path; only authenticated peers get it.
    await ctl.send({"t": "accept", "num_blocks": num_blocks, "pool": pool()})
    return Session(client_nonce + server_nonce, 0)
