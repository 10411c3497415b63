"""What the engine hands back: per-step token deltas and whole-request outputs.

Light on purpose (no torch at import): frontends import it, and Ray ships its classes.
"""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.engine.kv.events import KVEventBatch
from pdserve.engine.sequence import FinishReason

if TYPE_CHECKING:
    from pdserve.engine.kv.tiers import KVTierStats
    from pdserve.engine.sampler import TokenLogprobs
    from pdserve.engine.speculator import SpecMetrics

_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    """An OpenAI-style call id: `call_` and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call the model made: a function's name and its arguments as JSON object text."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """New tokens of one request since its last delta (ids only: text is the request
    processor's, `engine.request_processor.OutputStream`)."""

    request_id: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # The last delta of a `hold_kv` request: the blocks holding its KV, in position order,
    # so that whoever sends them needs no call into the engine; free with Engine.release.
    held_block_ids: tuple[int, ...] = ()
    # The first delta of a request that asked for them (`SamplingParams.prompt_logprobs`): one
    # entry per prompt token, None for the first (nothing predicts it).
    prompt_logprobs: tuple[TokenLogprobs | None, ...] = ()
    # With `held_block_ids`, where the engine drafts with the model's MTP layer: the target's hidden state at
    # the last prompt token (`MTPCarry.export`), which the decode worker's drafter starts from
    # (`Engine.admit_prefilled`'s draft_state); b"" otherwise.
    held_draft_state: bytes = b""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def merge_deltas(deltas: list[TokenDelta]) -> TokenDelta:
    """One delta for consecutive deltas of one request, in order: the tokens a request got in one
    step (several when speculating), or those a slow reader missed (`take_coalesced`)."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    return TokenDelta(last.request_id, tuple(t for d in deltas for t in d.token_ids), last.finish_reason,
                      tuple(lp for d in deltas for lp in d.logprobs), last.num_prompt_tokens, last.num_cached_tokens,
                      last.held_block_ids, deltas[0].prompt_logprobs, last.held_draft_state)


@dataclass(frozen=True, slots=True)
class AnswerDelta:
    """What a text delta adds to the answer as the APIs show it (engine/text/answer.py): a
    reasoning model's thinking apart from the content of a chat's answer, and the tool calls
    the content made (their text taken out of it). A raw prompt's answer is all content."""

    reasoning: str = ""
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    num_tool_calls: int = 0  # the answer's calls so far, these included (OpenAI's index of a streamed call)


@dataclass(frozen=True, slots=True)
class TextDelta:
    """A token delta with its text, as the offline API and the frontends stream it.

    A stop string ends it early: `token_ids` up to the one that completed it, `text` up to
    the stop string, finish_reason STOP (TOOL_CALLS when the answer made calls).
    """

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()
    num_cached_tokens: int = 0
    prompt_logprobs: tuple[TokenLogprobs | None, ...] = ()  # as TokenDelta's
    answer: AnswerDelta = AnswerDelta()  # `text` split as the APIs render it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """A whole request: prompt, generated tokens and text (and its answer's parts: `AnswerDelta`),
    why it stopped."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first.
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def add(self, delta: TextDelta) -> None:
        self.prompt_logprobs.extend(delta.prompt_logprobs)
        self.token_ids.extend(delta.token_ids)
        self.text += delta.text
        self.reasoning += delta.answer.reasoning
        self.content += delta.answer.content
        self.tool_calls.extend(delta.answer.tool_calls)
        self.logprobs.extend(delta.logprobs)
        self.finish_reason = delta.finish_reason
        self.num_cached_tokens = delta.num_cached_tokens


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """A worker's load, for the router and metrics."""

    num_running: int
    num_waiting: int
    num_receiving: int  # reserved for KV in flight from a prefill worker
    num_held: int  # finished prefills whose KV is being sent
    queued_prefill_tokens: int
    num_free_blocks: int
    num_blocks: int
    num_reservable_blocks: int  # what a new decode reservation may take (Scheduler.num_reservable_blocks)
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    num_preemptions: int
    # The same by (tenant, the priority's sign, count), for the metrics per tenant and priority class.
    preemptions_by: tuple[tuple[str, int, int], ...] = ()
    prompt_tokens_computed: int = 0  # prompt tokens this engine's steps computed (not served from any cache)
    spec: SpecMetrics | None = None  # speculation counters, when the engine speculates
    # The prefix cache's events since the last report (a worker's load report carries them:
    # `LoopWorker.load`; the engine's own `load()` leaves them for that).
    kv_events: KVEventBatch | None = None
    kv_tiers: KVTierStats | None = None  # the host and disk tiers' counters, when the engine has tiers
    # The KV a token takes as workers exchange it (`Engine.kv_wire_layout`): its kind ("kv": K and
    # V per KV head; "mla": one latent) and bytes across all layers ("": a worker that did not say).
    kv_layout: str = ""
    kv_bytes_per_token: int = 0
