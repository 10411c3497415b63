"""Iteration-level scheduler: pure Python, no torch.

One rule: each step, under a token budget, decide how far each sequence's
`num_computed_tokens` advances. Running sequences go first (a decode token,
the last token plus its proposed speculative tokens, or the rest of a chunked
prompt), then waiting ones are admitted while budget, blocks and seat count
allow. When blocks run out, the youngest running sequence is preempted: its
blocks are freed and it is recomputed later.

Requests have a priority (`SamplingParams.priority`, lower first, vLLM's): sequences wait
in priority order, arrival order within one priority, except that of those of the head's
priority the tenant running the fewest for its weight goes first (`tenant_share`). With `SchedulerConfig.policy`
"priority" (vLLM's `--scheduling-policy priority`) a preemption takes the lowest-priority
running sequence (the youngest among them) instead of the youngest, a waiting sequence
that cannot be admitted (no seat, or too few blocks for its first chunk) preempts running
ones of lower priority until it can be, a lower-priority prompt being computed in chunks
skips the steps in which a higher-priority one waits, and a decode worker may seat a received
sequence over `max_num_seqs` in the place of a lower-priority one (`can_seat`), which the next
step preempts.

The scheduler owns every sequence of the node through its whole life, disaggregated
ones included (as vLLM's WAITING_FOR_REMOTE_KVS): waiting, running, receiving (a
decode worker's seat and blocks reserved for KV another worker sends; landing once its
copy is queued, until that completes) and held (a prefill worker's finished sequence
whose blocks it keeps until their KV is sent).

It is also the one writer of a sequence's state (tests/test_ownership.py holds production
code to that): the engine hands it each step's results (`launched`, `take_token`,
`verified`, `propose`, `finish`) and never writes a sequence itself; the block manager
writes the block fields.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.engine import tenant_share
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.sequence import PLACEHOLDER_TOKEN_ID, FinishReason, Sequence, SequenceStatus, tokens_left


@dataclass(slots=True)
class ScheduledBatch:
    """What one step computes: `seqs[i]` advances by `num_new_tokens[i]`."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Blocks found below the pool (`BlockManager.match_lower`) and the pool blocks allocated
    # for them: the engine copies them in before this step runs.
    onboard: list[tuple[int, object]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


class KVReady(Protocol):
    """Completion of a copy of KV into a sequence's blocks (a CUDA event)."""

    def query(self) -> bool: ...


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int,
                 eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Sequence] = deque()
        self._waiting_tenants: Counter[str] = Counter()  # waiting sequences by tenant (`tenant_share`)
        self.running: list[Sequence] = []
        # RECEIVING: None while the KV is on its way, (first token, copy) once it is landing.
        self.receiving: dict[Sequence, tuple[int, KVReady] | None] = {}
        self.held: dict[str, Sequence] = {}  # finished, blocks kept until `release`
        self.num_preemptions = 0
        # By (tenant, the priority's sign): classes, not values, which a client picks (a bounded count).
        self.preemptions_by: Counter[tuple[str, int]] = Counter()
        # Prompt tokens steps computed (not those served from a cache, a tier or another worker).
        self.num_prompt_tokens_computed = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_reservable_blocks(self) -> int:
        """The KV-headroom rule, written once: blocks a new reservation may take, the free ones
        less a block of headroom for each sequence that runs or receives (so that admitting
        one does not force a preemption on the next step). The router reads it in the load."""
        return self.block_manager.num_free_blocks - len(self.running) - len(self.receiving)

    @property
    def num_seats_taken(self) -> int:
        """Sequences holding one of `max_num_seqs` seats: running, receiving their KV, and
        waiting (on a decode worker, only preempted ones, which go on when a seat is free)."""
        return len(self.running) + len(self.receiving) + len(self.waiting)

    def can_seat(self, priority: int, tenant: str = "", tenant_weight: float = 1.0) -> bool:
        """Whether a sequence of `priority` (and `tenant`) may take a seat (`reserve` on a decode
        worker): one is free, or, under the priority policy, fewer than `max_num_seqs` of the
        seated ones are of its priority or a higher one, or its tenant runs fewer than its share
        of those of its priority (`tenant_share.under_share`): the lowest-priority one of the
        tenant most over its share gives its seat up (`schedule` preempts while more than
        `max_num_seqs` run). Seats stay bounded: at most `max_num_seqs` taken beyond it so."""
        seated, cap = self.num_seats_taken, self.config.max_num_seqs
        if seated < cap:
            return True
        if self.config.policy != "priority" or seated >= 2 * cap:
            return False
        mine = [*self.running, *self.receiving, *self.waiting]
        if sum(s.params.priority <= priority for s in mine) < cap:
            return True
        if any(s.params.priority > priority for s in self.running):
            return False  # a lower-priority one would be the victim: no share of this priority to take
        peers = [(s.params.tenant, s.params.tenant_weight) for s in (*self.running, *self.receiving)
                 if s.params.priority == priority]
        return tenant_share.under_share(peers, tenant, tenant_weight)

    # Disaggregation ------------------------------------------------------

    def receive(self, seq: Sequence) -> None:
        """`seq` holds blocks (allocated by the caller) that another worker fills with its prompt's KV."""
        seq.status = SequenceStatus.RECEIVING
        self.receiving[seq] = None

    def land(self, seq: Sequence, first_token_id: int, copy: KVReady | None) -> None:
        """The KV of a receiving sequence is in its blocks once `copy` completes (None: now):
        run it from `first_token_id` on then. ValueError if it is not waiting for its KV."""
        if self.receiving.get(seq, 0) is not None:
            raise ValueError(f"request {seq.request_id!r} is not waiting for its KV")
        if copy is not None and not copy.query():
            self.receiving[seq] = (first_token_id, copy)
            return
        self._run_received(seq, first_token_id)

    @property
    def landing(self) -> list[KVReady]:
        """The copies still landing, oldest first."""
        return [entry[1] for entry in self.receiving.values() if entry is not None]

    def admit_landed(self) -> None:
        """Run the sequences whose KV copy has completed."""
        for seq, entry in list(self.receiving.items()):
            if entry is not None and entry[1].query():
                self._run_received(seq, entry[0])

    def pending_copy(self, seq: Sequence) -> KVReady | None:
        """The copy still landing in `seq`'s blocks, if any (wait for it before they are freed)."""
        entry = self.receiving.get(seq)
        return entry[1] if entry is not None else None

    def release(self, request_id: str) -> bool:
        """Free a held sequence's blocks (full ones stay in the prefix cache); False if none is held."""
        seq = self.held.pop(request_id, None)
        if seq is None:
            return False
        self.block_manager.free(seq)
        return True

    def _run_received(self, seq: Sequence, first_token_id: int) -> None:
        del self.receiving[seq]
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.token_ids.append(first_token_id)
        self.block_manager.cache_full_blocks(seq)  # only now: a prefix hit must find the KV there
        self.add_running(seq)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence, first: bool = False) -> None:
        """Into the waiting queue, kept in priority order: after the sequences of its priority
        or a higher one, or (`first`: a preempted one, which goes on before later arrivals)
        before those of its own. With one priority, an append (appendleft)."""
        priority, waiting = seq.params.priority, self.waiting
        if first:
            i = next((i for i, w in enumerate(waiting) if w.params.priority >= priority), len(waiting))
        else:
            i = next((i for i in range(len(waiting), 0, -1) if waiting[i - 1].params.priority <= priority), 0)
        waiting.insert(i, seq)
        self._waiting_tenants[seq.params.tenant] += 1

    def _unwait(self, seq: Sequence) -> None:
        """`seq` left the waiting queue: out of the count by tenant."""
        self._waiting_tenants[seq.params.tenant] -= 1
        if not self._waiting_tenants[seq.params.tenant]:
            del self._waiting_tenants[seq.params.tenant]

    def add_running(self, seq: Sequence) -> None:
        """Admit a sequence whose prompt KV is already in its blocks (received from a prefill worker)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        if self.config.policy == "priority":
            # Higher-priority decode tokens before lower-priority prompt chunks in the budget
            # (stable: arrival order within a priority, so `_victim` is unchanged).
            self.running.sort(key=lambda s: s.params.priority)
            self._preempt_over_seats(batch)
            self._preempt_for_waiting(batch, budget)
        num_for_priority = len(batch.preempted)
        budget = self._schedule_running(batch, budget)
        if len(batch.preempted) == num_for_priority:  # out of blocks: admitting more would only thrash
            self._schedule_waiting(batch, budget)
        return batch

    def _victim(self) -> Sequence:
        """The running sequence a preemption takes: the youngest, or under the priority policy
        the youngest of the lowest priority's tenant most over its share (`tenant_share.victim`)."""
        if self.config.policy == "priority":
            return tenant_share.victim(self.running)
        return self.running[-1]

    def _preempt_over_seats(self, batch: ScheduledBatch) -> None:
        """Preempt the lowest-priority running sequences while more than `max_num_seqs` run
        (received ones of a higher priority took their seats: `can_seat`)."""
        while len(self.running) > self.config.max_num_seqs:
            victim = self._victim()
            self.running.remove(victim)
            self._preempt(victim)
            batch.preempted.append(victim)

    def _preempt_for_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        """Preempt lower-priority running sequences while the first waiting one cannot be admitted."""
        bm = self.block_manager
        while self.waiting and self.running:
            head, victim = self.waiting[0], self._victim()
            if victim.params.priority <= head.params.priority:
                return
            first_chunk = min(head.num_tokens, budget)
            if (len(self.running) < self.config.max_num_seqs
                    and bm.num_blocks_needed(head, first_chunk) <= self.num_reservable_blocks):
                return
            self.running.remove(victim)
            self._preempt(victim)
            batch.preempted.append(victim)

    def _yields_prompt(self, seq: Sequence) -> bool:
        """Under the priority policy, a prompt being computed in chunks waits a step for a waiting
        sequence of higher priority (keeping its blocks), so that a long low-priority prompt
        does not hold every step's budget while the other waits for its first token."""
        return (self.config.policy == "priority" and bool(self.waiting)
                and seq.num_computed_tokens < seq.num_prompt_tokens
                and self.waiting[0].params.priority < seq.params.priority)

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.finishing or self._yields_prompt(seq):
                i += 1
                continue
            num_new = min(seq.num_tokens + len(seq.spec_token_ids) - seq.num_computed_tokens, budget)
            while not self.block_manager.allocate(seq, num_new):
                if seq.spec_token_ids:  # never preempt anyone to verify guesses: drop them instead
                    seq.spec_token_ids.clear()
                    num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
                    continue
                victim = self._victim()
                j = self.running.index(victim)
                del self.running[j]
                if j < i:  # passed earlier in this step (the priority policy): unscheduled
                    i -= 1
                    if victim in batch.seqs:
                        k = batch.seqs.index(victim)
                        budget += batch.num_new_tokens[k]
                        del batch.seqs[k], batch.num_new_tokens[k]
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
        if not self.waiting:  # most decode steps: no count of the running by tenant to make
            return
        bm = self.block_manager
        running = tenant_share.load([*self.running, *self.receiving])
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            at = tenant_share.next_waiting(self.waiting, running, self._waiting_tenants)
            seq = self.waiting[at]
            # A request that asks for its prompt's log-probabilities computes its whole prompt
            # (as vLLM does): cached blocks, in any tier, hold KV, not the logits of their positions.
            wants_logits = seq.params.prompt_logprobs is not None
            prefix = [] if wants_logits else bm.match_prefix(seq)
            lower = [] if wants_logits else bm.match_lower(seq, len(prefix))
            num_cached = (len(prefix) + len(lower)) * bm.block_size
            num_new = seq.num_tokens - num_cached
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    return
                num_new = budget
            # The blocks below the pool get fresh pool blocks, right after the pool's hit.
            if not bm.allocate(seq, len(lower) * bm.block_size + num_new, prefix):
                return
            batch.onboard += zip(seq.block_ids[len(prefix):len(prefix) + len(lower)], lower)
            del self.waiting[at]
            self._unwait(seq)
            running[seq.params.tenant] += 1
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
        self._enqueue(seq, first=True)
        self.num_preemptions += 1
        p = seq.params.priority
        self.preemptions_by[seq.params.tenant, (p > 0) - (p < 0)] += 1

    # A step's results ---------------------------------------------------

    def launched(self, seq: Sequence, num_new: int, samples: bool) -> None:
        """A queued step computes `num_new` more of `seq`'s tokens and, if it `samples`, a
        token whose id is a placeholder until the step resolves. A sequence whose placeholder
        is its last token by length is `finishing`: it is not scheduled again."""
        self.num_prompt_tokens_computed += max(0, min(num_new, seq.num_prompt_tokens - seq.num_computed_tokens))
        seq.num_computed_tokens += num_new
        if samples:
            seq.token_ids.append(PLACEHOLDER_TOKEN_ID)
            seq.finishing = seq.remaining_tokens(self.max_model_len) <= 0

    def take_token(self, seq: Sequence, token_id: int) -> tuple[int, FinishReason | None]:
        """A sampled token, in place of the oldest placeholder or after the last token: its
        position, and why it ends the sequence (a stop token or EOS, or the length rule),
        if it does. The caller then `finish`es it, keeping the tokens up to this one."""
        pos = seq.num_known_tokens  # placeholders only ever trail
        if pos == seq.num_tokens:
            seq.token_ids.append(token_id)
        else:
            seq.token_ids[pos] = token_id
        params = seq.params
        if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids):
            return pos, FinishReason.STOP
        # The length rule as of this token: later placeholders (overlapped steps) do not count.
        if tokens_left(params, seq.num_prompt_tokens, pos + 1, self.max_model_len) <= 0:
            return pos, FinishReason.LENGTH
        return pos, None

    def propose(self, seq: Sequence, token_ids: list[int]) -> None:
        """Draft tokens for the next step to verify after `seq`'s last token (the step's
        budget may keep fewer: `schedule`)."""
        seq.spec_token_ids[:] = token_ids

    def verified(self, seq: Sequence, num_emitted: int) -> None:
        """A step verified `seq`'s proposals and emits `num_emitted` tokens (the accepted
        ones and the target's own): the last token and the accepted proposals have KV now;
        the rejected ones' slots are garbage, overwritten or trimmed."""
        seq.spec_token_ids.clear()
        seq.num_computed_tokens = seq.num_tokens + num_emitted - 1

    def finish(self, seq: Sequence, reason: FinishReason, free_blocks: bool = True, hold: bool = False,
               num_tokens: int | None = None) -> None:
        """Take `seq` out at once (finished or aborted) and free its blocks, unless the
        caller frees them later itself (`free_blocks` False: a step still writes them) or
        `hold`s them (a prefill worker, until their KV is sent: `release`). Its tokens end at
        `num_tokens` (a token sampled after the last one is dropped) and before any placeholder."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            self._unwait(seq)
        elif seq.status is SequenceStatus.RECEIVING:
            del self.receiving[seq]
        if hold:
            self.held[seq.request_id] = seq
        elif free_blocks:
            self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finishing = False
        del seq.token_ids[min(seq.num_known_tokens, seq.num_tokens if num_tokens is None else num_tokens):]


# The draft model's shadow sequences ------------------------------------------------------
# A model drafter keeps, per target sequence, a shadow: the draft's own KV positions in its
# own block manager (`engine/speculative/draft_model.py`). The drafter decides when a shadow
# moves; these functions are the only code that writes one, so that every write to a
# `Sequence`, a target's or a shadow, is in this module.


def shadow_rewind(shadow: Sequence, num_tokens: int, token_ids: list[int] | tuple[int, ...] = (),
                  num_computed_tokens: int | None = None) -> None:
    """`shadow`'s tokens cut to its first `num_tokens`, then `token_ids` appended; its KV
    counted up to `num_computed_tokens` (default: `num_tokens`)."""
    del shadow.token_ids[num_tokens:]
    shadow.token_ids.extend(token_ids)
    shadow.num_computed_tokens = num_tokens if num_computed_tokens is None else num_computed_tokens


def shadow_advance(shadow: Sequence, num_new_tokens: int) -> None:
    """A draft step computed `num_new_tokens` more of `shadow`'s positions."""
    shadow.num_computed_tokens += num_new_tokens


def shadow_append_placeholders(shadow: Sequence, num_spec_tokens: int = 0) -> None:
    """One drafted token still on the device at `shadow`'s end (and, for a catch-up fed the
    positions a verification checked, `num_spec_tokens` more behind it as speculative ones)."""
    shadow.token_ids.append(PLACEHOLDER_TOKEN_ID)
    shadow.spec_token_ids[:] = [PLACEHOLDER_TOKEN_ID] * num_spec_tokens


def shadow_caught_up(shadow: Sequence, num_computed_tokens: int) -> None:
    """A catch-up's forward is queued: its KV covers `num_computed_tokens`, no speculative tail."""
    shadow.num_computed_tokens = num_computed_tokens
    shadow.spec_token_ids.clear()


def shadow_fill_drafted(shadow: Sequence, token_ids: list[int]) -> None:
    """The drafted tokens read back, in place of the `len(token_ids)` placeholders at `shadow`'s
    end (left as they are when those positions were rewritten since)."""
    tail = len(shadow.token_ids) - len(token_ids)
    if shadow.token_ids[tail:] == [PLACEHOLDER_TOKEN_ID] * len(token_ids):
        shadow.token_ids[tail:] = token_ids
