"""Transfer errors as they travel in control frames."""

from __future__ import annotations

from pdserve.kv_transport.api import PeerLost, TransferCancelled, TransferError, TransferRejected, TransferTimeout

# Only these may cross the wire; anything else from a peer reads as a rejection.
_KINDS: dict[str, type[TransferError]] = {
    cls.__name__: cls for cls in (TransferCancelled, TransferRejected, TransferTimeout, PeerLost)
}


def error_to_wire(error: TransferError | None) -> list[str] | None:
    return None if error is None else [type(error).__name__, str(error)]


def error_from_wire(value: object) -> TransferError | None:
    if value is None:
        return None
    if isinstance(value, list) and len(value) == 2:
        kind, message = value
        return _KINDS.get(str(kind), TransferRejected)(f"receiver: {message}")
    return TransferRejected(f"receiver sent a malformed error: {value!r}")
