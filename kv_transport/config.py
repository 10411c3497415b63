"""Configuration of the KV transport (frozen dataclasses, validated on construction).

`TransportSettings` holds every tunable and its default: it is also the `kv_transport`
section of `pdserve serve`'s config (cluster/settings/config.py embeds it). `TransportConfig` is
what a worker's transport runs with: those settings plus the cluster secret and the
worker's own address, which come from the environment and the worker's node, never
from a config file.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from dataclasses import dataclass, field

# Transport classes, fastest first. UCX transport names map onto these in transport_info.py.
TRANSPORT_CLASSES: tuple[str, ...] = ("cuda_ipc", "rdma", "shm", "tcp")
PROGRESS_MODES: tuple[str, ...] = ("blocking", "thread")  # "polling" spins a core


@dataclass(frozen=True, slots=True)
class TransportSettings:
    """How workers connect and move KV blocks: the `kv_transport` section of the serve config.

    Attributes:
        connect_timeout_s: bound on connecting plus the handshake.
        transfer_timeout_s: bound on one transfer, from `send()`/`expect()` to its result,
            measured from the sender's last sign of life: a sender keeps the waits of the
            requests it has prepared (whose KV it is still computing) alive every quarter
            of this (`keepalive_interval_s`), so a long prefill does not time out its decode side.
        allowed_transports: transport classes (see TRANSPORT_CLASSES: cuda_ipc, rdma, shm,
            tcp) KV may travel over; a peer reachable only over another one is refused
            with SlowPathRefused.
        require: the slowest transport a pair of workers may use: "cuda_ipc" (GPU to GPU on
            one host, NVLink or PCIe), "rdma", "shm" (one host's shared memory), "tcp", or
            "any" (whatever `allowed_transports` allows). A pair that reaches each other
            only over a slower one is refused when it connects, and its requests fail with
            FAILED_PRECONDITION naming the transport found, rather than being served slowly.
        progress_mode: ucxx progress mode for the process, "thread" or "blocking". "thread"
            (a UCX progress thread that completes the event loop's futures) idles at ~5% of
            a core per worker; "blocking" awaits every pending operation by yielding to the
            loop and so spins a core once a connection exists (90-95% per idle worker,
            2026-12-01), taking it from the engine: a 256-token CPU prefill behind a
            connection took 1.9 s instead of 1.0 s.
        progress_wake_ms: in "thread" mode, how long UCX's progress thread sleeps in epoll
            between wakes when no event arrives (ucxx's own is 1 ms: ~1000 wakes a second
            per worker, each taking a CPU from an engine thread: a CPU decode step at batch
            32 measured 85 -> 97 ms beside a process waking at 1 kHz, 2026-12-06). Events
            (a transfer's data, a connection) wake it at once whatever this is.
        direct_writes: between GPUs of one host, map the receiver's pool through a
            CUDA IPC handle and copy blocks straight into it (one NVLink pass, no
            staging). Off, or where the handle cannot be opened, KV travels as UCX messages.
    """

    connect_timeout_s: float = 5.0
    transfer_timeout_s: float = 30.0
    allowed_transports: frozenset[str] = frozenset(TRANSPORT_CLASSES)
    require: str = "any"
    progress_mode: str = "thread"
    progress_wake_ms: int = 100
    direct_writes: bool = True

    def __post_init__(self) -> None:
        for name in ("connect_timeout_s", "transfer_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"kv_transport.{name} must be > 0, got {getattr(self, name)}")
        # Accept any iterable (a YAML list, a flag's values) but store the frozen set.
        allowed = frozenset(self.allowed_transports)
        object.__setattr__(self, "allowed_transports", allowed)
        unknown = allowed - set(TRANSPORT_CLASSES)
        if not allowed or unknown:
            raise ValueError(f"kv_transport.allowed_transports must be some of {list(TRANSPORT_CLASSES)}, "
                             f"got {sorted(allowed)}")
        if self.require not in ("any", *TRANSPORT_CLASSES):
            raise ValueError(f"kv_transport.require must be 'any' or one of {list(TRANSPORT_CLASSES)}, "
                             f"got {self.require!r}")
        if not self.transports:
            raise ValueError(f"kv_transport.require {self.require!r} leaves none of allowed_transports "
                             f"{sorted(allowed)}")
        if self.progress_wake_ms < 1:
            raise ValueError(f"kv_transport.progress_wake_ms must be >= 1, got {self.progress_wake_ms}")
        if self.progress_mode not in PROGRESS_MODES:
            raise ValueError(f"kv_transport.progress_mode must be one of {PROGRESS_MODES}, "
                             f"got {self.progress_mode!r}")

    @property
    def transports(self) -> frozenset[str]:
        """The transport classes a pair may use: those allowed, as fast as `require` or faster."""
        if self.require == "any":
            return self.allowed_transports
        fast_enough = TRANSPORT_CLASSES[: TRANSPORT_CLASSES.index(self.require) + 1]  # fastest first
        return self.allowed_transports & frozenset(fast_enough)

    @property
    def keepalive_interval_s(self) -> float:
        """How often a sender names its prepared requests to their receivers: well inside
        the receivers' bound, so that a late beat or two does not time anything out."""
        return self.transfer_timeout_s / 4

    def allows(self, transport: str) -> bool:
        """Whether a detected transport class may carry KV. One UCX could not identify
        ("unknown") passes only when the operator restricted nothing."""
        if transport == "unknown":
            return self.transports == frozenset(TRANSPORT_CLASSES)
        return transport in self.transports


@dataclass(frozen=True, slots=True, kw_only=True)
class TransportConfig(TransportSettings):
    """A worker's transport: the settings (TransportSettings) plus who it is.

    Attributes:
        secret: cluster secret (>= 16 bytes). Peers prove they know it with an HMAC
            challenge-response; it never travels on the wire.
        listen_host: the address this worker is known by (its node's, see node.py): named in
            its PeerAddress for logs, and, when it is a loopback one (a local cluster), UCX
            keeps its network transports on the loopback device. Nothing listens on it for the
            transport: senders connect to a receiver's UCX worker address, which reaches
            them through Ray (PeerAddress), and authenticate with `secret`.
    """

    secret: bytes = field(repr=False)
    listen_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if not isinstance(self.secret, bytes) or len(self.secret) < 16:
            raise ValueError("TransportConfig.secret must be at least 16 bytes")
        if not self.listen_host:
            raise ValueError("TransportConfig.listen_host must not be empty")
        TransportSettings.__post_init__(self)  # not super(): slotted dataclasses are remade classes

    @classmethod
    def of(cls, settings: TransportSettings, secret: bytes, listen_host: str) -> TransportConfig:
        """The transport of a worker at `listen_host` with the cluster's `settings` and `secret`."""
        values = {f.name: getattr(settings, f.name) for f in dataclasses.fields(TransportSettings)}
        return cls(secret=secret, listen_host=listen_host, **values)

    @property
    def is_loopback(self) -> bool:
        """The worker's address is a loopback one: every peer is on this host."""
        try:
            return ipaddress.ip_address(self.listen_host).is_loopback
        except ValueError:  # a host name
            return self.listen_host == "localhost"
