"""Configuration of the KV transport (one frozen dataclass, validated on construction)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

# Transport classes, fastest first. UCX transport names map onto these in transport_info.py.
TRANSPORT_CLASSES: tuple[str, ...] = ("cuda_ipc", "rdma", "shm", "tcp")
PROGRESS_MODES: tuple[str, ...] = ("blocking", "thread")  # "polling" spins a core


@dataclass(frozen=True, slots=True)
class TransportConfig:
    """How workers connect and move KV blocks.

    Attributes:
        secret: cluster secret (>= 16 bytes). Peers prove they know it with an HMAC
            challenge-response; it never travels on the wire.
        listen_host: the address this worker is known by (its node's, see node.py): named in
            its PeerAddress for logs, and, when it is a loopback one (a local cluster), UCX
            keeps its network transports on the loopback device. Nothing listens on it for the
            transport: senders connect to a receiver's UCX worker address, which reaches
            them through Ray (PeerAddress), and authenticate with `secret`.
        connect_timeout_s: bound on connecting plus the handshake.
        transfer_timeout_s: bound on one transfer, from `send()`/`expect()` to its result,
            measured from the sender's last sign of life: a sender keeps the waits of the
            requests it has prepared (whose KV it is still computing) alive every quarter
            of this (`keepalive_interval_s`), so a long prefill does not time out its decode side.
        allowed_transports: transport classes (see TRANSPORT_CLASSES) a sender may use;
            a peer reachable only over another one is refused with SlowPathRefused.
        fast_data_path: send KV bytes over an endpoint made from the receiver's worker
            address without UCX error handling. UCX then picks shm/cma on one host
            (~5x faster than TCP here); peer loss is still caught by the control
            endpoint, which keeps error handling, and by the timeouts.
        progress_mode: ucxx progress mode for the process. "thread" (a UCX progress thread
            that completes the event loop's futures) idles at ~5% of a core per worker;
            "blocking" awaits every pending operation by yielding to the loop and so spins a
            core once a connection exists (90-95% per idle worker, 2026-12-01), taking it
            from the engine: a 256-token CPU prefill behind a connection took 1.9 s
            instead of 1.0 s.
        direct_writes: between GPUs of one host, map the receiver's pool through a
            CUDA IPC handle and copy blocks straight into it (one NVLink pass, no
            staging). Off, or where the handle cannot be opened, KV travels as UCX messages.
    """

    secret: bytes = field(repr=False)
    listen_host: str = "127.0.0.1"
    connect_timeout_s: float = 5.0
    transfer_timeout_s: float = 30.0
    allowed_transports: frozenset[str] = frozenset(TRANSPORT_CLASSES)
    fast_data_path: bool = True
    progress_mode: str = "thread"
    direct_writes: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.secret, bytes) or len(self.secret) < 16:
            raise ValueError("TransportConfig.secret must be at least 16 bytes")
        if not self.listen_host:
            raise ValueError("TransportConfig.listen_host must not be empty")
        for name in ("connect_timeout_s", "transfer_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"TransportConfig.{name} must be > 0, got {getattr(self, name)}")
        allowed = frozenset(self.allowed_transports)
        unknown = allowed - set(TRANSPORT_CLASSES)
        if not allowed or unknown:
            raise ValueError(
                f"TransportConfig.allowed_transports must be a non-empty subset of "
                f"{TRANSPORT_CLASSES}, got {sorted(allowed)}"
            )
        # Accept any iterable from YAML/CLI but store the frozen set.
        object.__setattr__(self, "allowed_transports", allowed)
        if self.progress_mode not in PROGRESS_MODES:
            raise ValueError(f"TransportConfig.progress_mode must be one of {PROGRESS_MODES}")

    @property
    def keepalive_interval_s(self) -> float:
        """How often a sender names its prepared requests to their receivers: well inside
        the receivers' bound, so that a late beat or two does not time anything out."""
        return self.transfer_timeout_s / 4

    @property
    def is_loopback(self) -> bool:
        """The worker's address is a loopback one: every peer is on this host."""
        try:
            return ipaddress.ip_address(self.listen_host).is_loopback
        except ValueError:  # a host name
            return self.listen_host == "localhost"

    def allows(self, transport: str) -> bool:
        """Whether a detected transport class may carry KV. One UCX could not identify
        ("unknown") passes only when the operator restricted nothing."""
        if transport == "unknown":
            return self.allowed_transports == frozenset(TRANSPORT_CLASSES)
        return transport in self.allowed_transports
