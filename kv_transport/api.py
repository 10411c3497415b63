"""What callers of the KV transport see: protocols, results and typed errors.

Ownership rule: the transport never allocates or frees KV blocks. The caller passes
the block ids it holds; when a transfer fails, the caller frees them.
`release_on_failure` makes that hard to get wrong.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


class TransferError(Exception):
    """A transfer did not land. The caller should free its blocks and report upward."""


class HandshakeRefused(TransferError):
    """The peer's layout fingerprint or cluster secret did not match."""


class TransferTimeout(TransferError):
    """The transfer did not complete within `TransportConfig.transfer_timeout_s`."""


class PeerLost(TransferError):
    """The connection to the peer broke (process died, network error, closed)."""


class TransferCancelled(TransferError):
    """One side cancelled the request (or shut down) before its KV landed."""


class SlowPathRefused(TransferError):
    """The only transport UCX found to the peer is not in `allowed_transports`."""


class PeerReplaced(TransferError):
    """The receiver at the request's address is not the incarnation it was addressed to
    (that worker was replaced, and its address reused): refused at once, not parked."""


class TransferRejected(TransferError):
    """The receiver refused this request: unknown id, or a block-count mismatch."""


@dataclass(frozen=True, slots=True)
class PeerAddress:
    """How senders reach a receiver, passed to them out of band (through Ray): no listener,
    no port. `worker_address` is the receiver's UCX worker address (opaque bytes, which a
    sender connects to); `host` is the address its worker is known by (its node's), for logs;
    `incarnation` names this life of the receiver: one started again is a new one, and a
    sender refuses to send what was addressed to the old (PeerReplaced). "" matches any.
    `proof`: the receiver's proof of the cluster secret over its worker address
    (handshake.prove_address), so that a sender with another secret refuses at once."""

    host: str
    worker_address: bytes = field(default=b"", repr=False)
    incarnation: str = ""
    proof: str = field(default="", repr=False)


@dataclass(frozen=True, slots=True)
class TransferResult:
    """Outcome of one request's transfer, on either side.

    Attributes:
        request_id: the caller's request id.
        num_bytes: KV bytes moved (the request's blocks, all layers, K and V).
        transport: transport class used ("cuda_ipc", "rdma", "shm", "tcp",
            "loopback", or "unknown" when it failed before one was chosen).
        elapsed_s: from `send()`/`expect()` to this result (a send with `after` counts
            the wait for the KV's computation too).
        error: None on success, else why it failed.
        direct: the KV was written straight into the receiver's pool (CUDA IPC) rather
            than sent as UCX messages.
        ready: receiver side, GPU pools: the copy into the pool may still be running (the
            sender's direct write, or our scatter of a message); the KV is there once this
            CUDA event completes. Query it from the host (a direct write's is the sender's,
            shared through CUDA IPC: a stream's wait on it lags ~85 us). None: the KV is
            there already.
    """

    request_id: str
    num_bytes: int
    transport: str
    elapsed_s: float
    error: TransferError | None = None
    direct: bool = False
    ready: torch.cuda.Event | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def raise_for_error(self) -> None:
        if self.error is not None:
            raise self.error


class KVSender(Protocol):
    """The prefill side: pushes a request's KV blocks to a receiver."""

    async def send(
        self, request_id: str, block_ids: Sequence[int], peer: PeerAddress, after: torch.cuda.Event | None = None
    ) -> TransferResult:
        """Copy `block_ids` of the local pool into the blocks the receiver expects.

        Args:
            request_id: id the receiver registered with `expect()`.
            block_ids: local block ids, in sequence order. They may be freed or reused as
                soon as this returns.
            peer: the receiver's `address`.
            after: the KV is complete once this CUDA event has completed (the copy is queued
                behind it, so that it can be sent while the GPU still computes). None: it is
                complete now (on a GPU, the caller has synchronized with the work that wrote
                it: a direct write copies on a stream of its own, not after the caller's).

        Returns:
            A result that is ok once the KV has landed in the receiver's pool. Never
            raises TransferError and always returns within the transfer timeout.

        Raises:
            ValueError: bad block ids or a request id already in flight (caller bug).
        """
        ...

    def prepare(self, request_id: str, peer: PeerAddress) -> None:
        """Optional hint, before the KV exists: get ready to send `request_id` to `peer`.

        Lets whatever `send()` would wait for (connecting; a direct-write peer's grant of
        its blocks) travel while the KV is computed. Returns at once and never fails; call
        `forget()` when `send()` may not follow, or the peer holds its grant until the timeout.
        """
        ...

    def forget(self, request_id: str) -> None:
        """Withdraw a `prepare()` that `send()` did not consume (no-op otherwise)."""
        ...

    async def close(self) -> None:
        """Drop every connection; in-flight sends end with PeerLost or TransferCancelled."""
        ...


class KVReceiver(Protocol):
    """The decode side: lands KV blocks sent for requests it expects."""

    @property
    def address(self) -> PeerAddress:
        """Where senders reach this receiver."""
        ...

    def expect(self, request_id: str, block_ids: Sequence[int]) -> Awaitable[TransferResult]:
        """Register, at once, local blocks to land `request_id` into.

        Args:
            request_id: id the sender will use.
            block_ids: local block ids, in sequence order, as many as the sender sends.

        Returns:
            An awaitable resolving to a TransferResult within the transfer timeout.
            On failure the blocks hold garbage and belong to the caller to free.

        Raises:
            ValueError: bad block ids or `request_id` already expected.
        """
        ...

    def cancel(self, request_id: str) -> None:
        """Resolve a pending `expect()` with TransferCancelled (no-op if already done)."""
        ...

    async def close(self) -> None:
        """Stop taking senders; pending expects resolve with TransferCancelled."""
        ...


async def release_on_failure(
    transfer: Awaitable[TransferResult], release: Callable[[], None]
) -> TransferResult:
    """Await a transfer; call `release()` exactly once if it failed or was cancelled.

    The one place where the caller's "free my blocks on failure" lives, so that a
    timeout, a peer crash and a cancelled caller task all take the same path.
    """
    ok = False
    try:
        result = await transfer
        ok = result.ok
        return result
    finally:
        if not ok:
            release()
