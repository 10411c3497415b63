"""Iteration-level scheduler: pure Python, no torch.

One rule: each step, under a token budget, decide how far each sequence's
`num_computed_tokens` advances. Running sequences go first (a decode token,
the last token plus its proposed speculative tokens, or the rest of a chunked
prompt), then waiting ones are admitted while budget, blocks and seat count
allow. When blocks run out, the youngest running sequence is preempted: its
blocks are freed and it is recomputed later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledBatch:
    """What one step computes: `seqs[i]` advances by `num_new_tokens[i]`."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Admit a sequence whose prompt KV is already in its blocks (received from a prefill worker)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(batch, budget)
        if not batch.preempted:  # out of blocks: admitting more would only thrash
            self._schedule_waiting(batch, budget)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.finishing:
                i += 1
                continue
            num_new = min(seq.num_tokens + len(seq.spec_token_ids) - seq.num_computed_tokens, budget)
            while not self.block_manager.allocate(seq, num_new):
                if seq.spec_token_ids:  # never preempt anyone to verify guesses: drop them instead
                    seq.spec_token_ids.clear()
                    num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
                    continue
                victim = self.running.pop()  # the youngest
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    return budget
            # Proposals past the budget are not verified this step.
            del seq.spec_token_ids[max(0, seq.num_computed_tokens + num_new - seq.num_tokens):]
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
            i += 1
        return budget

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            prefix = bm.match_prefix(seq)
            num_cached = len(prefix) * bm.block_size
            num_new = seq.num_tokens - num_cached
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    return
                num_new = budget
            if not bm.allocate(seq, num_new, prefix):
                return
            self.waiting.popleft()
            seq.num_computed_tokens = num_cached
            seq.num_cached_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.spec_token_ids.clear()
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: FinishReason, free_blocks: bool = True) -> None:
        """Take `seq` out at once (finished or aborted) and free its blocks unless
        the caller keeps them (a prefill worker until its KV is sent)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        if free_blocks:
            self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
