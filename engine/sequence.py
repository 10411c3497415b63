"""The node-local, mutable state of one request, owned by the scheduler."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pdserve.engine.block_hash import hash_block_tokens, salt_seed
from pdserve.engine.sampling import SamplingParams

# A token sampled by a step whose result has not reached the host yet (overlapped steps):
# it sits at the end of `token_ids` until the step resolves; the next step reads it on the device.
PLACEHOLDER_TOKEN_ID = -1


def tokens_left(params: SamplingParams, num_prompt_tokens: int, num_tokens: int, max_model_len: int) -> int:
    """The length-stop rule, written once: how many more tokens a request of `num_tokens`
    (`num_prompt_tokens` of them its prompt) may get before `max_tokens` or the model's
    context ends it (0 or less: it has ended)."""
    return min(params.max_tokens - (num_tokens - num_prompt_tokens), max_model_len - num_tokens)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    RECEIVING = "receiving"  # holds blocks whose KV another worker is sending
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled by the caller
    # A chat's answer that made tool calls stopped: set by the request processor's OutputStream
    # (engine/text/answer.py) in place of STOP, never by the engine.
    TOOL_CALLS = "tool_calls"


@dataclass(slots=True, eq=False, weakref_slot=True)
class Sequence:
    """One request as this node sees it.

    The engine's one rule: `num_computed_tokens` moves toward `num_tokens`. A
    step advances it by a prompt chunk, one decode token or the last token plus
    K proposed ones (`spec_token_ids`); when it catches up, the step's sampled
    token (or the accepted proposals and one more) is appended.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    block_size: int
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (last admission)
    num_preemptions: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Owned by the block manager: block_ids only grow until this is bumped (they were
    # freed or trimmed), so a mirror of them can be kept up to date by appending.
    block_table_version: int = 0
    num_published_blocks: int = 0  # leading blocks whose hashes are in the prefix cache
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    # Draft tokens to verify after the last token this step (speculative decoding);
    # never part of token_ids, so hashes, stop checks and counts ignore them.
    spec_token_ids: list[int] = field(default_factory=list)
    # Its last token is still in flight and it ends after it (length): not scheduled again.
    finishing: bool = False
    # Output tokens an earlier attempt generated, now the end of the prompt (a request
    # continued on another worker): its output indices count on from them.
    num_prior_output_tokens: int = 0
    _block_hashes: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host has: all but trailing placeholders (see PLACEHOLDER_TOKEN_ID)."""
        n = len(self.token_ids)
        while n and self.token_ids[n - 1] == PLACEHOLDER_TOKEN_ID:
            n -= 1
        return n

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def next_output_index(self) -> int:
        """The output index of the next token sampled, counting an earlier attempt's tokens
        (what a seeded request's random numbers are keyed by: `Sampler.noise`)."""
        return self.num_prior_output_tokens + self.num_output_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def remaining_tokens(self, max_model_len: int) -> int:
        """`tokens_left` of this sequence: 0 or less once it has ended by length."""
        return tokens_left(self.params, self.num_prompt_tokens, self.num_tokens, max_model_len)

    def block_hashes(self, num_blocks: int) -> list[int]:
        """Chained hashes of the first `num_blocks` full blocks (computed once, kept), the
        first seeded by the request's `cache_salt`."""
        hashes = self._block_hashes
        bs = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else salt_seed(self.params.cache_salt)
            hashes.append(hash_block_tokens(parent, self.token_ids[i * bs:(i + 1) * bs]))
        return hashes[:num_blocks]
