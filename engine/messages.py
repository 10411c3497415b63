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
class PrefillOutput:
    """The first token, and whether the request still needs a decode worker."""

    first: TokenDelta
    needs_decode: bool
    transfer: KVTransferInfo | None
