"""Scheduler: token budget, chunked prefill, iteration-level joins and leaves, preemption,
priorities (waiting order, and the priority policy's preemptions)."""

from __future__ import annotations

import pytest

from pdserve.engine.config import SchedulerConfig
from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import PLACEHOLDER_TOKEN_ID, FinishReason, Sequence, SequenceStatus

BS = 4


def make(num_blocks: int = 64, budget: int = 16, max_seqs: int = 8, chunked: bool = True,
         policy: str = "fcfs") -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                     enable_chunked_prefill=chunked, policy=policy), BlockManager(num_blocks, BS), 4096)


def seq(n: int, rid: str, first: int = 0, priority: int = 0) -> Sequence:
    return Sequence(rid, tuple(range(first, first + n)), SamplingParams(priority=priority), BS)


def complete(sched: Scheduler, batch, token: int = 99) -> None:
    """What the engine does after the model ran: advance, and append a token where caught up."""
    for s, n in zip(batch.seqs, batch.num_new_tokens):
        s.num_computed_tokens += n
        sched.block_manager.cache_full_blocks(s)
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(token)


def test_long_prompt_is_chunked_under_the_budget():
    sched = make(budget=16)
    long = seq(40, "long", first=1000)
    sched.add(long)
    sizes = []
    while long.num_computed_tokens < 40:
        batch = sched.schedule()
        assert batch.num_tokens <= 16
        sizes.append(batch.num_new_tokens[0])
        complete(sched, batch)
    assert sizes == [16, 16, 8]


def test_without_chunking_a_prompt_waits_for_a_whole_budget():
    sched = make(budget=16, chunked=False)
    sched.add(seq(20, "big"))
    assert len(sched.schedule()) == 0


def test_decodes_run_beside_a_prefill_and_waiting_join_next_step():
    sched = make(budget=16)
    a = seq(3, "a")
    sched.add(a)
    complete(sched, sched.schedule())  # a prefilled, now decoding
    b = seq(30, "b", first=500)
    sched.add(b)
    batch = sched.schedule()
    assert batch.seqs == [a, b] and batch.num_new_tokens == [1, 15]
    complete(sched, batch)
    sched.finish(a, FinishReason.STOP)  # leaves at once
    c = seq(2, "c", first=900)
    sched.add(c)
    batch = sched.schedule()
    assert batch.seqs == [b, c] and batch.num_new_tokens == [15, 1]
    assert a.status is SequenceStatus.FINISHED and a.block_ids == []


def test_max_num_seqs_bounds_the_batch():
    sched = make(budget=100, max_seqs=2)
    for i in range(3):
        sched.add(seq(2, f"s{i}", first=10 * i))
    assert len(sched.schedule()) == 2


def test_preempted_sequence_restarts_from_zero_and_goes_first():
    sched = make(num_blocks=3, budget=64)
    a, b = seq(4, "a"), seq(4, "b", first=50)
    sched.add(a)
    sched.add(b)
    complete(sched, sched.schedule())  # each holds 1 full block and now has a 5th token
    batch = sched.schedule()  # both need a 2nd block, one is free: b, the youngest, is preempted
    assert batch.preempted == [b] and batch.seqs == [a]
    assert b.num_computed_tokens == 0 and b.block_ids == [] and sched.waiting[0] is b
    assert b.num_preemptions == 1
    assert len(a.block_ids) == 2 and sched.block_manager.num_free_blocks == 1
    complete(sched, batch)
    sched.finish(a, FinishReason.STOP)
    batch = sched.schedule()  # b comes back and recomputes all 5 tokens (its full block from the cache)
    assert batch.seqs == [b] and b.num_computed_tokens + batch.num_new_tokens[0] == 5


def test_waiting_sequences_go_in_priority_order_then_arrival():
    sched = make(budget=100, max_seqs=1)
    order = [seq(2, "late-batch", priority=5), seq(2, "chat", priority=-1), seq(2, "normal"),
             seq(2, "chat2", priority=-1), seq(2, "normal2")]
    for s in order:
        sched.add(s)
    assert [s.request_id for s in sched.waiting] == ["chat", "chat2", "normal", "normal2", "late-batch"]
    assert sched.schedule().seqs[0].request_id == "chat"


def test_fcfs_preempts_the_youngest_whatever_its_priority():
    sched = make(num_blocks=3, budget=64)
    a, b = seq(4, "a", priority=3), seq(4, "b", first=50, priority=-3)
    sched.add(a)
    sched.add(b)  # b waits ahead of a, so b runs first and is the older
    complete(sched, sched.schedule())
    assert sched.running == [b, a]
    assert sched.schedule().preempted == [a]
    sched2 = make(num_blocks=3, budget=64, max_seqs=1)
    sched2.add(seq(4, "low", priority=3))
    complete(sched2, sched2.schedule())
    sched2.add(seq(4, "high", first=50, priority=-3))  # no seat: fcfs lets it wait
    assert sched2.schedule().preempted == []


def test_priority_policy_preempts_the_lowest_priority_when_blocks_run_out():
    sched = make(num_blocks=3, budget=64, policy="priority")
    low, high = seq(4, "low", priority=1), seq(4, "high", first=50)
    sched.add(low)
    complete(sched, sched.schedule())
    sched.add(high)
    complete(sched, sched.schedule())
    assert sched.running == [low, high]  # both need a 2nd block, one is free
    batch = sched.schedule()  # fcfs would take high, the youngest; this policy takes low
    assert batch.preempted == [low] and batch.seqs == [high] and low.num_computed_tokens == 0
    assert sched.waiting[0] is low and len(high.block_ids) == 2
    assert sched.preemptions_by == {("", 1): 1}  # the metrics' preempted sequences, by tenant and priority


def test_a_victim_already_scheduled_this_step_is_unscheduled():
    sched = make(num_blocks=4, budget=64, policy="priority")
    low, high = seq(4, "low", priority=1), seq(8, "high", first=50)
    sched.add(low)
    complete(sched, sched.schedule())  # low: 1 block, 5 tokens
    sched.add(high)
    complete(sched, sched.schedule())  # high: 2 blocks, 9 tokens; low now holds 2 blocks
    assert sched.block_manager.num_free_blocks == 0 and sched.running == [low, high]
    batch = sched.schedule()  # low (first) has its block; high needs a 3rd: low is taken back
    assert batch.preempted == [low] and batch.seqs == [high] and batch.num_new_tokens == [1]
    assert low.block_ids == [] and sched.waiting[0] is low


def test_priority_policy_preempts_for_a_higher_priority_arrival():
    sched = make(num_blocks=64, budget=64, max_seqs=2, policy="priority")
    lows = [seq(4, f"low{i}", first=10 * i, priority=2) for i in range(2)]
    for s in lows:
        sched.add(s)
    complete(sched, sched.schedule())  # both seats taken
    same = seq(4, "same", first=100, priority=2)
    sched.add(same)  # the same priority waits
    assert sched.schedule().preempted == []
    high = seq(4, "high", first=200, priority=0)
    sched.add(high)
    batch = sched.schedule()
    assert batch.preempted == [lows[1]] and high in batch.seqs and lows[0] in batch.seqs
    assert [s.request_id for s in sched.waiting] == ["low1", "same"]  # the preempted one first of its priority


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_low_priority_prompt_in_chunks_yields_its_steps_to_a_higher_one(policy):
    sched = make(budget=16, policy=policy)
    long = seq(40, "long", first=1000, priority=1)
    sched.add(long)
    complete(sched, sched.schedule())
    high = seq(4, "high", first=2000, priority=0)
    sched.add(high)
    batch = sched.schedule()
    if policy == "fcfs":
        assert batch.seqs == [long] and batch.num_new_tokens == [16], "fcfs: the prompt in progress goes on"
        return
    assert batch.seqs == [high] and not batch.preempted, "the low prompt keeps its blocks and waits a step"
    complete(sched, batch)
    batch = sched.schedule()  # nobody of higher priority waits: the prompt goes on from where it was,
    # after the higher priority's decode token (which came second, but the budget is taken in priority order)
    assert batch.seqs == [high, long] and batch.num_new_tokens == [1, 15] and long.num_computed_tokens == 16


def test_priority_policy_preempts_for_blocks_too():
    sched = make(num_blocks=4, budget=64, max_seqs=8, policy="priority")
    low = seq(12, "low", priority=1)
    sched.add(low)
    complete(sched, sched.schedule())  # 3 blocks and a 13th token; 1 free
    high = seq(8, "high", first=100)
    sched.add(high)  # needs 2 blocks
    batch = sched.schedule()
    assert batch.preempted == [low] and batch.seqs == [high]


class Copy:
    """A KV copy that completes when the test says so (stands in for a CUDA event)."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def receiving(sched: Scheduler, n: int, rid: str, first: int = 0, priority: int = 0) -> Sequence:
    s = seq(n, rid, first, priority)
    assert sched.block_manager.allocate(s, s.num_tokens)
    sched.receive(s)
    return s


def test_a_received_sequence_runs_once_its_kv_has_landed():
    sched = make()
    s = receiving(sched, 20, "r")
    assert s.status is SequenceStatus.RECEIVING and sched.num_seats_taken == 1 and not sched.has_unfinished
    copy = Copy()
    sched.land(s, 7, copy)
    assert sched.landing == [copy] and not sched.schedule().seqs, "a landing sequence is not scheduled"
    sched.admit_landed()
    assert sched.landing == [copy], "admitted before its copy completed"
    copy.done = True
    sched.admit_landed()
    assert s.status is SequenceStatus.RUNNING and not sched.receiving and sched.num_seats_taken == 1
    assert s.token_ids[-1] == 7 and s.num_computed_tokens == 20
    batch = sched.schedule()
    assert batch.seqs == [s] and batch.num_new_tokens == [1]  # decodes from the first token on
    with pytest.raises(ValueError, match="not waiting for its KV"):
        sched.land(s, 7, None)


def test_a_receiving_sequence_that_finishes_gives_back_its_seat_and_blocks():
    sched = make(num_blocks=16)
    s = receiving(sched, 40, "r")
    copy = Copy()
    sched.land(s, 7, copy)
    assert sched.pending_copy(s) is copy
    sched.finish(s, FinishReason.ABORT)
    assert not sched.receiving and sched.num_seats_taken == 0 and sched.pending_copy(s) is None
    assert sched.block_manager.num_free_blocks == 16


def test_a_received_sequence_of_higher_priority_takes_the_seat_of_a_lower_one():
    sched = make(budget=64, max_seqs=2, policy="priority")
    lows = [receiving(sched, 4, f"low{i}", first=10 * i, priority=1) for i in range(2)]
    for low in lows:
        sched.land(low, 7, None)
    complete(sched, sched.schedule())
    assert not sched.can_seat(1) and not sched.can_seat(2), "a full worker seats no one of the same priority or lower"
    assert sched.can_seat(0)
    high = receiving(sched, 4, "high", first=50, priority=0)
    sched.land(high, 7, None)
    batch = sched.schedule()
    assert batch.preempted == [lows[1]], "the youngest of the lowest priority gives its seat up"
    assert set(batch.seqs) == {lows[0], high} and list(sched.waiting) == [lows[1]]
    assert sched.num_seats_taken == 3, "the preempted one keeps a seat: it waits to go on"
    assert sched.can_seat(0) and not sched.can_seat(1)
    receiving(sched, 4, "high2", first=60, priority=0)
    assert not sched.can_seat(-5), "at most max_num_seqs seats are taken beyond max_num_seqs"
    complete(sched, batch)
    sched.finish(lows[0], FinishReason.LENGTH)
    sched.finish(high, FinishReason.LENGTH)
    sched.land(sched_seq(sched, "high2"), 7, None)
    batch = sched.schedule()
    assert lows[1] in batch.seqs and not sched.waiting, "the preempted one goes on once a seat is free"


def test_fcfs_seats_no_one_beyond_max_num_seqs():
    sched = make(budget=64, max_seqs=1)
    low = receiving(sched, 4, "low", priority=1)
    sched.land(low, 7, None)
    assert not sched.can_seat(-5)


def sched_seq(sched: Scheduler, rid: str) -> Sequence:
    return next(s for s in sched.receiving if s.request_id == rid)


def test_a_held_sequence_keeps_its_blocks_until_released():
    sched = make(num_blocks=16, budget=64)
    s = seq(40, "p")
    sched.add(s)
    complete(sched, sched.schedule())
    sched.finish(s, FinishReason.LENGTH, hold=True)
    assert s.is_finished and sched.held == {"p": s} and sched.block_manager.num_free_blocks == 16 - 10
    assert sched.release("p") and not sched.held and sched.block_manager.num_free_blocks == 16
    assert not sched.release("p")


def test_a_steps_results_go_through_the_scheduler():
    """launched -> placeholders; take_token fills the oldest one and applies the stop and
    length rules as of that token; finish keeps the tokens up to it and drops placeholders."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16), BlockManager(64, BS), max_model_len=12,
                      eos_token_ids=frozenset({2}))
    s = Sequence("a", (10, 11, 12), SamplingParams(max_tokens=4, stop_token_ids=[7]), BS)
    sched.add(s)
    batch = sched.schedule()
    sched.launched(s, batch.num_new_tokens[0], samples=True)
    sched.launched(s, 1, samples=True)  # the next step, queued before the first resolved
    assert s.token_ids == [10, 11, 12, PLACEHOLDER_TOKEN_ID, PLACEHOLDER_TOKEN_ID] and s.num_computed_tokens == 4
    assert s.remaining_tokens(sched.max_model_len) == 2 and not s.finishing
    assert sched.take_token(s, 5) == (3, None)
    assert sched.take_token(s, 7) == (4, FinishReason.STOP)  # a stop token
    sched.finish(s, FinishReason.STOP, num_tokens=5)
    assert s.token_ids == [10, 11, 12, 5, 7] and s.is_finished and s.finish_reason is FinishReason.STOP

    t = Sequence("b", (1,) * 9, SamplingParams(max_tokens=8, ignore_eos=True), BS)
    sched.add(t)
    batch = sched.schedule()
    sched.launched(t, batch.num_new_tokens[0], samples=True)
    assert sched.take_token(t, 2) == (9, None)  # EOS ignored
    sched.launched(t, 1, samples=True)
    sched.launched(t, 1, samples=True)  # its context (12) ends with this placeholder
    assert t.finishing and t.remaining_tokens(sched.max_model_len) == 0
    assert sched.take_token(t, 3) == (10, None)
    assert sched.take_token(t, 4) == (11, FinishReason.LENGTH)
    sched.propose(t, [8, 9])
    sched.verified(t, 2)  # one proposal accepted and the target's own token
    assert t.spec_token_ids == [] and t.num_computed_tokens == t.num_tokens + 1
    sched.launched(t, 0, samples=True)  # a placeholder past the end is dropped at finish
    sched.finish(t, FinishReason.LENGTH)
    assert t.token_ids == [1] * 9 + [2, 3, 4] and not t.finishing
