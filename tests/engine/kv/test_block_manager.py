"""Block manager: unit tests and a stateful property test (no leak, no double free)."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.sequence import Sequence

BS = 4


def seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, tuple(tokens), SamplingParams(), BS)


def admit(bm: BlockManager, s: Sequence) -> bool:
    """What the scheduler does: take the cached prefix, allocate the rest, mark computed."""
    prefix = bm.match_prefix(s)
    if not bm.allocate(s, s.num_tokens - len(prefix) * BS, prefix):
        return False
    s.num_computed_tokens = s.num_tokens
    bm.cache_full_blocks(s)
    return True


def test_allocate_is_all_or_nothing():
    bm = BlockManager(num_blocks=3, block_size=BS)
    s = seq(list(range(13)))  # needs 4 blocks
    assert not bm.can_allocate(s, 13)
    assert not bm.allocate(s, 13)
    assert s.block_ids == [] and bm.num_free_blocks == 3


def test_prefix_is_shared_and_survives_free_until_evicted():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    assert admit(bm, a)
    b = seq([1, 2, 3, 4, 5, 6, 7, 8, 10], "b")
    assert admit(bm, b)
    assert b.block_ids[:2] == a.block_ids[:2]
    assert bm.ref_count(a.block_ids[0]) == 2
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 4
    c = seq([1, 2, 3, 4, 5, 6, 7, 8, 11], "c")  # revives the freed, still-cached blocks
    prefix = bm.match_prefix(c)
    assert len(prefix) == 2
    # Filling the pool with unrelated tokens evicts them.
    d = seq(list(range(100, 116)), "d")
    assert admit(bm, d)
    assert bm.match_prefix(seq([1, 2, 3, 4, 5, 6, 7, 8, 12], "e")) == []


def test_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(num_blocks=4, block_size=BS)
    assert admit(bm, seq(list(range(8)), "a"))
    again = seq(list(range(8)), "b")
    assert len(bm.match_prefix(again)) == 1  # not 2: one token must be left to compute


def test_uncached_blocks_are_reused_before_cached_ones():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = seq(list(range(8)), "a")
    assert admit(bm, a)  # two full, hashed blocks
    b = seq([50, 51], "b")
    assert admit(bm, b)  # one partial block, never hashed
    a_blocks, b_blocks = list(a.block_ids), list(b.block_ids)
    bm.free(a)
    bm.free(b)
    c = seq([60], "c")
    assert bm.allocate(c, 1)
    assert c.block_ids == b_blocks and not set(c.block_ids) & set(a_blocks)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / append / free / preempt over shared prefixes."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(num_blocks=12, block_size=BS)
        self.running: list[Sequence] = []
        self.next_id = 0

    @rule(prefix=st.sampled_from([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [7, 7, 7, 7], []]),
          suffix=st.lists(st.integers(0, 20), min_size=1, max_size=10))
    def add(self, prefix: list[int], suffix: list[int]) -> None:
        s = seq(prefix + suffix, f"s{self.next_id}")
        self.next_id += 1
        if admit(self.bm, s):
            self.running.append(s)
        else:
            assert s.block_ids == []

    @precondition(lambda self: self.running)
    @rule(data=st.data(), num_new=st.integers(1, 6))
    def append(self, data: st.DataObject, num_new: int) -> None:
        s = data.draw(st.sampled_from(self.running))
        before = list(s.block_ids)
        if self.bm.allocate(s, num_new):
            s.token_ids.extend(range(30, 30 + num_new))
            s.num_computed_tokens = s.num_tokens
            self.bm.cache_full_blocks(s)
            assert s.block_ids[:len(before)] == before
        else:
            assert s.block_ids == before

    @precondition(lambda self: self.running)
    @rule(data=st.data(), preempt=st.booleans())
    def free(self, data: st.DataObject, preempt: bool) -> None:
        s = data.draw(st.sampled_from(self.running))
        self.bm.free(s)
        self.running.remove(s)
        if preempt:  # recompute later: the same tokens come back through the prefix cache
            s.num_computed_tokens = 0
            if admit(self.bm, s):
                self.running.append(s)

    @invariant()
    def counts_match_holders(self) -> None:
        held: dict[int, int] = {}
        for s in self.running:
            assert len(s.block_ids) == len(set(s.block_ids)), "a sequence holds a block twice"
            assert len(s.block_ids) * BS >= s.num_tokens
            for b in s.block_ids:
                held[b] = held.get(b, 0) + 1
        for b in range(self.bm.num_blocks):
            assert self.bm.ref_count(b) == held.get(b, 0), f"block {b}: ref count vs holders"
        assert self.bm.num_free_blocks == self.bm.num_blocks - len(held)

    def teardown(self) -> None:
        for s in self.running:
            self.bm.free(s)
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert all(self.bm.ref_count(b) == 0 for b in range(self.bm.num_blocks))


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
