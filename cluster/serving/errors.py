"""The errors a request meets in the cluster, and what a client may be told about an error
raised in a worker (what stays in the server's log).

An exception raised inside a Ray actor reaches the caller as a `RayTaskError` (a subclass of
both `RayTaskError` and the original exception's class, so `except TransferError` still
matches it) whose `str()` is Ray's text: the actor's name, pid, ip and the remote Python
traceback with the workers' file paths. That text belongs in the server's log, never in a
gRPC status or an HTTP error body. `cause` gives the one line a client sees: the original
exception's own message.
"""

from __future__ import annotations

from ray.exceptions import RayActorError, RayError, RayTaskError

MAX_CAUSE_CHARS = 500  # a client-facing cause is a line, not a dump


# What the coordinator raises to the frontends (each maps to a gRPC status and an HTTP one).

class WorkerUnavailable(Exception):
    """No healthy worker could take the request, or its worker was lost mid-request."""


class WorkerLost(WorkerUnavailable):
    """A worker the request ran on was lost, or its KV transfer failed: it may continue elsewhere."""


class TransportRefused(WorkerUnavailable):
    """The request's pair of workers may not move KV between them: a refused handshake (layout,
    secret) or a transport slower than `kv_transport.require` allows. The cluster's
    configuration, not a passing failure: another attempt would be refused too."""


class Overloaded(Exception):
    """Every worker is full: the caller should back off (RESOURCE_EXHAUSTED)."""


def original(error: BaseException) -> BaseException:
    """The exception the actor raised: `error` without Ray's wrappers (nested ones too, when
    an actor's call failed in another actor)."""
    seen = set()
    while isinstance(error, RayTaskError) and id(error) not in seen:
        seen.add(id(error))
        cause = getattr(error, "cause", None)
        if not isinstance(cause, BaseException) or cause is error:
            break
        error = cause
    return error


def cause(error: BaseException) -> str:
    """A one-line, client-safe description of `error`: the original exception's own message
    (its first line, at most MAX_CAUSE_CHARS), its class name when it has none. Ray's own
    errors (an actor gone, an object lost) say only which kind they are: their text names
    processes, addresses and, for an actor that died in its constructor, its traceback."""
    error = original(error)
    if isinstance(error, RayActorError):
        return f"the worker's Ray actor is gone ({type(error).__name__})"
    if isinstance(error, RayError):
        return f"Ray failed the call ({type(error).__name__})"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else type(error).__name__
    if text.startswith("Traceback (most recent call last)"):  # a traceback put into a message by hand
        text = type(error).__name__
    return text if len(text) <= MAX_CAUSE_CHARS else text[: MAX_CAUSE_CHARS - 3] + "..."
