"""Small messages that cross process boundaries between the frontend and workers."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.outputs import TokenDelta
from pdserve.engine.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class WorkerRequest:
    """A validated, tokenized request as a worker receives it (stop strings stay with the frontend)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class KVTransferInfo:
    """How a request's KV moved from its prefill worker to its decode worker."""

    num_bytes: int
    transport: str
    elapsed_s: float
    direct: bool = False  # written straight into the decode pool (CUDA IPC), not sent as messages


@dataclass(frozen=True, slots=True)
class PrefillTimes:
    """Where a prefill call's time went inside the prefill worker, in seconds (durations, so
    that no two machines' clocks are compared).

    queue_s: the call's start until the engine took the request (it waits for the engine's
        current step to end).
    compute_s: taken until the first token reached the worker's event loop (the prompt's
        wait behind other prompts, its forward passes, sampling, the hand-off between threads).
    kv_wait_s: first token until its KV was sent (the rest of a send that started behind the
        prompt's forward).
    """

    queue_s: float
    compute_s: float
    kv_wait_s: float

    @property
    def total_s(self) -> float:
        return self.queue_s + self.compute_s + self.kv_wait_s


@dataclass(frozen=True, slots=True)
class PrefillOutput:
    """The first token, and whether the request still needs a decode worker."""

    first: TokenDelta
    needs_decode: bool
    transfer: KVTransferInfo | None
    times: PrefillTimes | None = None
