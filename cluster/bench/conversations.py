"""`pdserve bench --dataset multi-turn`: conversations that resend their whole past.

Each conversation opens with one of a few shared system prompts; turn 1's prompt is that
system prompt and a user message, and turn k+1's prompt is turn k's prompt, the answer the
server gave it and a new user message (the way a chat client resends its history). A
conversation's turns go one after another, each once the previous answer is complete; the
conversations arrive as a Poisson process at `request_rate` conversations/s (or all at once)
and run side by side, at most `max_concurrency` requests in flight. A turn waits for a place
in line behind the turns already waiting (first come, first served), so that, while many
conversations are open, a conversation's next turn comes after the others' turns: its user
"thinks" while the server serves them, and its prefix must outlive their traffic in the
cache (the reuse distance that makes a KV cache smaller than the context miss).

Token ids throughout (no tokenizer: the answers' ids are appended as they came), random and
seeded, so every run of a workload sends the same first turns; with greedy sampling the
later turns are the same too. It needs an API that returns the answer's token ids: pdserve's
gRPC one.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

from pdserve.cluster.bench.backends import Backend, RequestResult
from pdserve.cluster.bench.dataset import BenchRequest, random_ids
from pdserve.cluster.bench.runner import LoadShape, RunResult, paced


@dataclass(frozen=True, slots=True)
class MultiTurnWorkload:
    """The conversations' shape. Context of a conversation's last turn:
    system_len + num_turns * (user_len + output_len) - output_len tokens."""

    num_conversations: int
    num_turns: int
    num_system_prompts: int
    system_len: int  # tokens of each shared system prompt
    user_len: int  # tokens of each user message
    output_len: int  # tokens of each answer
    vocab_size: int
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_conversations", "num_turns", "num_system_prompts", "user_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"multi-turn {name} must be at least 1, got {getattr(self, name)}")
        if self.system_len < 0:
            raise ValueError(f"multi-turn system_len must be >= 0, got {self.system_len}")

    @property
    def num_requests(self) -> int:
        return self.num_conversations * self.num_turns

    @property
    def distinct_context_tokens(self) -> int:
        """Tokens of KV the workload makes at its end, shared prefixes counted once: what caches
        that kept everything would hold (each conversation's last context, plus its last answer)."""
        per_conversation = self.num_turns * (self.user_len + self.output_len)
        return self.num_system_prompts * self.system_len + self.num_conversations * per_conversation

    def conversations(self) -> list[Conversation]:
        rng = random.Random(self.seed)
        systems = [random_ids(rng, self.system_len, self.vocab_size) for _ in range(self.num_system_prompts)]
        return [Conversation(systems[i % len(systems)],
                             [random_ids(rng, self.user_len, self.vocab_size) for _ in range(self.num_turns)],
                             self.output_len)
                for i in range(self.num_conversations)]


@dataclass(frozen=True, slots=True)
class Conversation:
    system_ids: tuple[int, ...]
    user_ids: list[tuple[int, ...]]  # one message per turn
    output_len: int

    async def run(self, backend: Backend, limit: asyncio.Semaphore, timeout_s: float) -> list[RequestResult]:
        """Its turns, one after another, each holding a place of `limit` while it runs; a failed
        turn ends the conversation."""
        context = list(self.system_ids)
        results = []
        for user in self.user_ids:
            context += user
            async with limit:
                result = await backend.send(BenchRequest(self.output_len, prompt_ids=tuple(context)), timeout_s)
            results.append(result)
            if not result.ok or len(result.output_ids) != result.output_tokens:
                result.error = result.error or "the API gave no answer token ids (multi-turn needs gRPC)"
                break
            context += result.output_ids
        return results


async def run_multi_turn(backend: Backend, workload: MultiTurnWorkload, shape: LoadShape,
                         progress: bool = True) -> RunResult:
    """Every conversation of `workload`; results in conversation order, then turn order."""
    conversations = workload.conversations()
    limit = asyncio.Semaphore(shape.max_concurrency or len(conversations))  # FIFO: asyncio wakes waiters in order
    done, duration = await paced(conversations, lambda c: c.run(backend, limit, shape.timeout_s), shape,
                                 "multi-turn", "conv", progress)
    return RunResult(shape, [r for results in done for r in results], duration)
