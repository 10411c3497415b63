"""KV events: what a replay of an engine's events builds is what its prefix cache holds."""

from __future__ import annotations

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import Engine
from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.kv.events import (
    DEVICE_TIER,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventFanout,
    KVEvent,
    KVEventBatch,
    KVEventRecorder,
)
from pdserve.engine.sampling import SamplingParams
from tests.engine.kv.test_block_manager import BS, admit, seq
from tests.engine.prompts import prompt_ids


def replay(batches: list[KVEventBatch]) -> dict[int, int | None]:
    """Cached hash -> parent hash, as the events say; asserts their numbers run without a gap."""
    blocks: dict[int, int | None] = {}
    expected = 0
    for batch in batches:
        assert batch.first_seq == expected, "a gap in the event numbers"
        expected = batch.next_seq
        for event in batch.events:
            apply(blocks, event)
    return blocks


def apply(blocks: dict[int, int | None], event: KVEvent) -> None:
    assert event.tier == DEVICE_TIER
    if isinstance(event, BlockStored):
        assert event.block_hash not in blocks, "stored twice without a removal"
        blocks[event.block_hash] = event.parent_hash
    elif isinstance(event, BlockRemoved):
        del blocks[event.block_hash]
    else:
        assert isinstance(event, AllBlocksCleared)
        blocks.clear()


def test_stored_removed_and_cleared_with_their_chain():
    events = KVEventRecorder(max_pending=100)
    bm = BlockManager(num_blocks=3, block_size=BS, events=events)
    a = seq(list(range(9)), "a")  # two full blocks and one token
    assert admit(bm, a)
    first = events.take()
    h0, h1 = a.block_hashes(2)
    assert first.first_seq == 0 and first.events == (BlockStored(h0, None), BlockStored(h1, h0))
    bm.free(a)
    b = seq(list(range(100, 109)), "b")  # needs all 3 blocks: evicts both cached ones
    assert admit(bm, b)
    second = events.take()
    assert second.first_seq == 2
    assert set(second.events[:2]) == {BlockRemoved(h0), BlockRemoved(h1)}
    g0, g1 = b.block_hashes(2)
    assert replay([first, second]) == {g0: None, g1: g0} and set(bm.cached_hashes()) == {g0, g1}
    assert not bm.reset_prefix_cache()  # b holds blocks
    bm.free(b)
    assert bm.reset_prefix_cache() and bm.cached_hashes() == ()
    assert events.take().events == (AllBlocksCleared(),)
    assert bm.match_prefix(seq(list(range(100, 109)))) == []


def test_an_overflow_drops_the_oldest_and_leaves_a_gap_in_the_numbers():
    events = KVEventRecorder(max_pending=2)
    events.record([BlockStored(1, None), BlockStored(2, 1), BlockStored(3, 2)])
    batch = events.take()
    assert batch.first_seq == 1 and batch.events == (BlockStored(2, 1), BlockStored(3, 2))
    assert events.take() == KVEventBatch(events.incarnation, 3, ())  # an empty batch still says where it is
    assert events.snapshot({DEVICE_TIER: (2, 3)}).next_seq == 3
    assert KVEventRecorder(1).incarnation != events.incarnation


def test_a_replay_of_the_events_equals_the_cache_after_evictions_and_preemptions(small_model, tokenizer):
    # 24 blocks of 16 tokens for 6 prompts of ~100-200 tokens that share prefixes, each
    # generating 40: sequences are preempted and cached blocks evicted.
    engine = Engine(EngineConfig(model=small_model.engine_config(), cache=CacheConfig(num_blocks=24),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=64)))
    shared = prompt_ids(tokenizer, 64, variant=1)
    prompts = [shared + prompt_ids(tokenizer, 40 + 20 * i, variant=2 + i % 3) for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    batches = []
    for wave in (prompts[:4], prompts[2:]):
        for prompt in wave:
            engine.add_request(prompt, params)
        while engine.has_unfinished:
            engine.step()
            batches.append(engine.kv_events.take())
    assert engine.scheduler.num_preemptions > 0
    assert any(isinstance(e, BlockRemoved) for b in batches for e in b.events)
    replayed = replay(batches)
    bm = engine.block_manager
    # Block by block: every block the manager finds by a hash is in the replay, and nothing else.
    held = {bm._hash_of_block[b] for b in range(bm.num_blocks) if bm._hash_of_block[b] is not None}
    assert held == set(replayed) == set(bm.cached_hashes())
    snapshot = engine.kv_snapshot()
    assert snapshot.next_seq == batches[-1].next_seq and set(snapshot.block_hashes[DEVICE_TIER]) == held


def test_a_fanout_gives_every_reader_every_event_once_and_a_late_or_slow_reader_a_gap():
    recorder = KVEventRecorder(max_pending=100)
    fanout = EventFanout(max_pending=3, forget_after_s=10.0)
    recorder.record([BlockStored(1, None), BlockStored(2, 1)])
    a = fanout.take("a", recorder.take(), now=0.0)
    assert (a.first_seq, a.events) == (0, (BlockStored(1, None), BlockStored(2, 1)))
    recorder.record([BlockRemoved(2)])
    b = fanout.take("b", recorder.take(), now=1.0)  # a late reader: from here on, after a gap it must resync over
    assert (b.first_seq, b.events) == (2, (BlockRemoved(2),))
    recorder.record([BlockStored(3, None)])
    b2 = fanout.take("b", recorder.take(), now=2.0)
    a2 = fanout.take("a", recorder.take(), now=2.0)  # a's buffer held what b took meanwhile
    assert (a2.first_seq, a2.events) == (2, (BlockRemoved(2), BlockStored(3, None)))
    assert (b2.first_seq, b2.events) == (3, (BlockStored(3, None),))
    recorder.record([BlockStored(h, None) for h in range(10, 15)])  # more than a reader's bound
    fanout.take("a", recorder.take(), now=3.0)
    b3 = fanout.take("b", recorder.take(), now=3.0)
    assert b3.first_seq == 4 + 2 and len(b3.events) == 3  # its oldest two dropped: a gap, it resyncs
    recorder.next_seq += 1  # the recorder lost one (an overflow): every reader sees the gap
    recorder.record([BlockStored(20, None)])
    a4 = fanout.take("a", recorder.take(), now=4.0)
    assert (a4.first_seq, a4.events) == (recorder.next_seq - 1, (BlockStored(20, None),))
    fanout.take("a", recorder.take(), now=20.0)  # b silent for longer than forget_after_s: forgotten
    assert fanout.readers == ("a",)
