"""StepInputBuilder against a plain per-token construction of the same inputs, across the
ways a sequence's blocks change between steps (growth, preemption, speculative trims,
row reuse after a sequence is gone)."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.runner.model_runner import StepLogits
from pdserve.engine.runner.step_inputs import StepInputBuilder
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.sequence import Sequence

BS = 4


def _reference(seqs: list[Sequence], num_new: list[int]) -> dict[str, list]:
    ids, pos, slots, logits_rows, lens, tables = [], [], [], [], [], []
    for seq, n in zip(seqs, num_new):
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        toks = seq.token_ids + seq.spec_token_ids
        ids += toks[start:end]
        pos += list(range(start, end))
        slots += [seq.block_ids[p // BS] * BS + p % BS for p in range(start, end)]
        if end >= seq.num_tokens:
            logits_rows += list(range(len(ids) - 1 - (end - seq.num_tokens), len(ids)))
        lens.append(end)
        tables.append(list(seq.block_ids))
    return {"ids": ids, "pos": pos, "slots": slots, "logits": logits_rows, "lens": lens, "tables": tables}


def _check(inputs, seqs: list[Sequence], num_new: list[int]) -> None:
    ref = _reference(seqs, num_new)
    meta = inputs.meta
    assert inputs.input_ids.tolist() == ref["ids"]
    assert inputs.positions.tolist() == ref["pos"]
    assert meta.slot_mapping.tolist() == ref["slots"]
    assert inputs.logits_indices.tolist() == ref["logits"]
    nd = meta.num_decodes
    assert meta.decode_seq_lens.tolist() + meta.prefill_seq_lens.tolist() == ref["lens"]
    assert meta.decode_seq_lens_host + meta.prefill_seq_lens_host == ref["lens"]
    q_lens = num_new[nd:]
    assert meta.prefill_q_lens_host == q_lens
    assert meta.prefill_cu_seqlens_q.tolist() == [sum(q_lens[:i]) for i in range(len(q_lens) + 1)]
    for i, table in enumerate(ref["tables"]):
        got = meta.decode_block_tables[i] if i < nd else meta.prefill_block_tables[i - nd]
        assert got[:len(table)].tolist() == table, i


def _seq(rid: str, prompt_len: int, rng: random.Random) -> Sequence:
    return Sequence(rid, tuple(rng.randrange(100) for _ in range(prompt_len)), SamplingParams(), BS)


def test_builder_matches_reference_through_block_changes():
    rng = random.Random(0)
    bm = BlockManager(200, BS, enable_prefix_caching=False)
    builder = StepInputBuilder(BS, 16, 64, 8, torch.device("cpu"))
    seqs = [_seq(f"s{i}", n, rng) for i, n in enumerate([3, 9, 14, 5])]
    # Step 1: every prompt as one chunk (the last one split: 2 of its 5 tokens).
    num_new = [3, 9, 14, 2]
    for seq, n in zip(seqs, num_new):
        assert bm.allocate(seq, n)
    _check(builder.build(seqs, num_new), seqs, num_new)
    for seq, n in zip(seqs, num_new):
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(rng.randrange(100))
    for step in range(12):  # decodes (crossing block boundaries), then the rest of the chunked prompt
        num_new = [1, 1, 1, seqs[3].num_tokens - seqs[3].num_computed_tokens]
        if step == 3:  # a speculative verification: the last token and three proposals
            seqs[1].spec_token_ids = [7, 8, 9]
            num_new[1] = 4
        order = [0, 2, 1, 3] if step == 3 else [0, 1, 2, 3]
        batch = [seqs[i] for i in order]
        nums = [num_new[i] for i in order]
        for seq, n in zip(batch, nums):
            assert bm.allocate(seq, n)
        _check(builder.build(batch, nums), batch, nums)
        for seq, n in zip(batch, nums):
            seq.num_computed_tokens += n
            if seq.spec_token_ids:  # one proposal accepted, the rest trimmed
                seq.num_computed_tokens = seq.num_tokens + 1
                seq.token_ids += [seq.spec_token_ids[0], 5]
                seq.spec_token_ids = []
                bm.trim(seq, seq.num_computed_tokens)
            elif seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(rng.randrange(100))
        if step == 6:  # preempt s2: new blocks, recomputed from scratch
            bm.free(seqs[2])
            seqs[2].num_computed_tokens = 0
            # Take blocks first so the recomputed one cannot get its old ids back by chance.
            filler = _seq("filler", 40, rng)
            assert bm.allocate(filler, 40)
            assert bm.allocate(seqs[2], seqs[2].num_tokens - 1)
            _check(builder.build([seqs[2]], [seqs[2].num_tokens - 1]), [seqs[2]], [seqs[2].num_tokens - 1])
            seqs[2].num_computed_tokens = seqs[2].num_tokens - 1


def test_rows_are_reused_after_a_sequence_is_gone():
    rng = random.Random(1)
    bm = BlockManager(400, BS, enable_prefix_caching=False)
    builder = StepInputBuilder(BS, 8, 64, 8, torch.device("cpu"))
    for round_ in range(100):  # far more sequences than rows ever exist at once
        seqs = [_seq(f"r{round_}-{i}", 6, rng) for i in range(4)]
        for seq in seqs:
            assert bm.allocate(seq, 6)
        _check(builder.build(seqs, [6] * 4), seqs, [6] * 4)
        for seq in seqs:
            bm.free(seq)
        del seqs  # freed at once, by reference counting: a collection here cost CI's workers 34 s a run
    assert builder._rows.table.shape[0] <= 64


def test_graph_padding_writes_and_attends_nothing():
    rng = random.Random(2)
    bm = BlockManager(100, BS, enable_prefix_caching=False)
    builder = StepInputBuilder(BS, 8, 16, 8, torch.device("cpu"))
    graph = builder.graph_inputs(8, 8)
    seqs = [_seq(f"g{i}", 5 + i, rng) for i in range(3)]
    for seq in seqs:
        assert bm.allocate(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens - 1
    inputs = builder.build(seqs, [1, 1, 1], graph=(8, 8))
    # The same views the graph was captured over, now holding this batch plus padding.
    assert inputs.input_ids.data_ptr() == graph.input_ids.data_ptr()
    assert inputs.meta.decode_block_tables.data_ptr() == graph.meta.decode_block_tables.data_ptr()
    assert inputs.meta.slot_mapping.tolist()[3:] == [-1] * 5
    assert inputs.meta.decode_seq_lens.tolist() == [5, 6, 7, 0, 0, 0, 0, 0]
    for i, seq in enumerate(seqs):
        assert inputs.meta.decode_block_tables[i, :len(seq.block_ids)].tolist() == seq.block_ids
    assert [(s.request_id, first, n) for s, first, n in inputs.spans] == [("g0", 0, 1), ("g1", 1, 1), ("g2", 2, 1)]


@pytest.mark.parametrize("q, num_proposed", [(3, 2), (2, 0)])
def test_graph_steps_of_several_tokens_after_an_eager_step(q, num_proposed):
    # q = K + 1: a verification (the last token and K proposals); q = 2 with none: a draft's
    # catch-up of two known tokens, logits after the last one only. An eager step in between
    # overwrites the shared buffers, which the graph step must write whole again.
    rng = random.Random(4)
    bm = BlockManager(100, BS, enable_prefix_caching=False)
    builder = StepInputBuilder(BS, 8, 32, 8, torch.device("cpu"))
    graph = builder.graph_inputs(4, 8, q)
    builder.graph_inputs(1, 8, 1)  # another graph's padding (its slots lie over this one's ids) ...
    builder.graph_inputs(4, 8, q)  # ... and this one's again, as a graph's timing replays do
    assert graph.input_ids.tolist() == [0] * 4 * q and graph.meta.slot_mapping.tolist() == [-1] * 4 * q
    seqs = [_seq(f"v{i}", 6 + 3 * i, rng) for i in range(2)]
    for seq in seqs:
        seq.spec_token_ids = [rng.randrange(100) for _ in range(num_proposed)]
        assert bm.allocate(seq, seq.num_tokens + num_proposed)
        seq.num_computed_tokens = seq.num_tokens + num_proposed - q
    other = _seq("eager", 20, rng)
    assert bm.allocate(other, 20)
    _check(builder.build([other], [20]), [other], [20])
    inputs = builder.build(seqs, [q, q], graph=(4, 8))
    assert inputs.input_ids.data_ptr() == graph.input_ids.data_ptr()
    assert inputs.meta.prefill_block_tables.data_ptr() == graph.meta.prefill_block_tables.data_ptr()
    ref = _reference(seqs, [q, q])
    pad = 2 * q
    assert inputs.input_ids.tolist() == ref["ids"] + [0] * pad
    assert inputs.positions.tolist() == ref["pos"] + [0] * pad
    assert inputs.meta.slot_mapping.tolist() == ref["slots"] + [-1] * pad
    meta = inputs.meta
    lens = meta.decode_seq_lens if q == 1 else meta.prefill_seq_lens
    assert lens.tolist() == ref["lens"] + [0, 0]
    assert meta.prefill_cu_seqlens_q.tolist() == [q * i for i in range(5)]
    for i, seq in enumerate(seqs):
        assert meta.prefill_block_tables[i, :len(seq.block_ids)].tolist() == seq.block_ids
    count = 1 + num_proposed
    assert [(s.request_id, first, n) for s, first, n in inputs.spans] == [
        ("v0", q - count, count), ("v1", 2 * q - count, count)]


def test_oversized_batch_is_refused_unless_growable():
    rng = random.Random(3)
    bm = BlockManager(100, BS, enable_prefix_caching=False)
    seq = _seq("big", 30, rng)
    assert bm.allocate(seq, 30)
    with pytest.raises(ValueError, match="exceeds the input buffers"):
        StepInputBuilder(BS, 16, 16, 2, torch.device("cpu")).build([seq], [30])
    grows = StepInputBuilder(BS, 16, 16, 2, torch.device("cpu"), growable=True)
    _check(grows.build([seq], [30]), [seq], [30])


def test_step_logits_hand_rows_on_as_views_where_they_are_evenly_spaced():
    rng = random.Random(5)
    seqs = [_seq(f"l{i}", 3, rng) for i in range(4)]
    values = torch.arange(10 * 6, dtype=torch.float32).view(10, 6)
    consecutive = StepLogits(values, {s: (i, 1) for i, s in enumerate(seqs)})
    rows = consecutive.rows_of(seqs)
    assert rows.data_ptr() == values.data_ptr() and torch.equal(rows, values[:4])
    every_second = StepLogits(values, {s: (2 * i + 1, 1) for i, s in enumerate(seqs)})  # a draft's catch-up
    rows = every_second.rows_of(seqs)
    assert torch.equal(rows, values[1:9:2]) and rows.data_ptr() == values[1].data_ptr()
    uneven = StepLogits(values, {s: (f, 1) for s, f in zip(seqs, [0, 1, 5, 6])})
    assert torch.equal(uneven.rows_of(seqs), values[[0, 1, 5, 6]])
    assert torch.equal(uneven.rows_of(seqs[2:]), values[5:7])
    spans = StepLogits(values, {seqs[0]: (0, 3), seqs[1]: (3, 1)})
    assert torch.equal(spans[seqs[0]], values[:3]) and seqs[0] in spans
    assert torch.equal(spans.pop(seqs[0]), values[:3]) and seqs[0] not in spans and list(spans) == [seqs[1]]


def test_a_graph_replayed_over_another_layout_is_refused():
    """Issue 53: the benchmark replayed the batch-256 graph after steps of a smaller bucket
    (the card's pool held fewer sequences); the larger graph's token ids then lay over the
    smaller one's slots, past the vocabulary, and the embedding's gather asserted on the
    device. Here: a pool of 100 blocks, a 2-sequence graph step whose slots reach ~380 (past a vocabulary of 100); the
    8-sequence graph's ids now hold them. The replay checks the layout first."""
    rng = random.Random(5)
    bm = BlockManager(100, BS, enable_prefix_caching=False)
    builder = StepInputBuilder(BS, 8, 32, 8, torch.device("cpu"))
    wide = builder.graph_inputs(8, 8)
    builder.graph_inputs(2, 8)
    seqs = [_seq(f"p{i}", 9, rng) for i in range(2)]
    for _ in range(90):  # blocks taken, so these two sequences get the last of the pool
        assert bm.allocate(_seq("filler", 1, rng), 1)
    for seq in seqs:
        assert bm.allocate(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens - 1
    small = builder.build(seqs, [1, 1], graph=(2, 8))
    builder.check_graph_layout(2, 8, 1)
    slots = small.meta.slot_mapping.tolist()
    assert min(slots) >= 90 * BS and wide.input_ids[4:6].tolist() == slots  # ids a vocabulary of 100 has not
    for other in ((8, 8, 1), (2, 4, 1), (2, 8, 2)):
        with pytest.raises(ValueError, match=r"the step inputs hold \(2, 8, 1\), not the layout of the graph"):
            builder.check_graph_layout(*other)
    builder.build(seqs, [1, 1], graph=(8, 8))
    builder.check_graph_layout(8, 8, 1)
    builder.build(seqs, [1, 1])  # an eager step: no graph's layout
    with pytest.raises(ValueError, match="the step inputs hold an eager step"):
        builder.check_graph_layout(8, 8, 1)


def test_the_hotpath_benchmark_refuses_what_its_pool_or_the_last_step_cannot_give():
    """Issue 53's benchmark: on an 80 GB card Qwen3-30B-A3B's pool held 7,614 blocks (RESULTS,
    2026-12-06), not the 26,624 of 256 sequences at ~1.5k context, so the batch-256 figures are
    refused and offline runs 59 at a time; a decode graph is timed only over the layout the
    last step built, never over a smaller bucket's or an eager step's inputs."""
    from benchmarks.hotpath import graph_refusal, offline_max_running, step_refusal

    assert step_refusal(7614, 16) == ("the KV pool holds 7614 blocks; 256 sequences at ~1.5k context need 26624: "
                                      "the batch-256 and mixed figures are refused")
    assert step_refusal(26624, 16) is None and offline_max_running(7614, 16, 512) == 59
    # Issue 53: offline runs as many as the pool holds to their end (128 blocks of 16 a 1k/1k
    # sequence), up to the seats: no longer at most 256 where an FP8 pool holds ~480.
    assert offline_max_running(61_500, 16, 512) == 480 and offline_max_running(70_000, 16, 512) == 512
    assert offline_max_running(70_000, 16, 256) == 256 and offline_max_running(100, 16, 512) == 1
    rng = random.Random(7)
    bm = BlockManager(40, BS, enable_prefix_caching=False)
    builder = StepInputBuilder(BS, 8, 32, 8, torch.device("cpu"))
    builder.graph_inputs(8, 8)
    seqs = [_seq(f"p{i}", 9, rng) for i in range(2)]
    for seq in seqs:
        assert bm.allocate(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens - 1
    builder.build(seqs, [1, 1], graph=(2, 8))
    assert graph_refusal(builder.graph_layout, 8) == ("the last step left the inputs of (2, 8, 1), not of a decode "
                                                      "graph of 8")
    assert graph_refusal(builder.graph_layout, 2) is None
    builder.build(seqs, [1, 1])
    assert "the inputs of an eager step" in graph_refusal(builder.graph_layout, 2)
    assert graph_refusal((), 8) is None  # a baseline tree that keeps no layout: not known


def test_decode_table_ids_name_a_sequence_while_its_table_only_grows():
    rng = random.Random(3)
    bm = BlockManager(100, BS, enable_prefix_caching=False)
    builder = StepInputBuilder(BS, 16, 64, 8, torch.device("cpu"))
    seqs = [_seq(f"t{i}", 6, rng) for i in range(2)]
    for s in seqs:
        assert bm.allocate(s, s.num_tokens)
        s.num_computed_tokens = s.num_tokens
        s.token_ids.append(1)
    del s  # no reference to seqs[1] but the list's: its row is recycled below

    def decode_ids(batch: list[Sequence]) -> tuple[int, ...]:
        for seq in batch:
            assert bm.allocate(seq, 1)
        ids = builder.build(batch, [1] * len(batch)).meta.decode_table_ids
        for seq in batch:
            seq.num_computed_tokens += 1
            seq.token_ids.append(1)
        return ids

    first = decode_ids(seqs)
    assert len(set(first)) == 2
    assert decode_ids(seqs) == first and decode_ids(seqs) == first  # grown across a block boundary
    assert decode_ids(seqs[::-1]) == first[::-1]
    bm.trim(seqs[0], seqs[0].num_computed_tokens - BS)  # blocks trimmed: a new table
    seqs[0].num_computed_tokens -= BS
    trimmed = decode_ids(seqs)
    assert trimmed[0] not in first and trimmed[1] == first[1]
    bm.free(seqs[1])
    row = builder._rows.update(seqs[1])
    del seqs[1]  # its row is recycled for the next sequence
    newcomer = _seq("t-new", 6, rng)
    assert bm.allocate(newcomer, newcomer.num_tokens)
    newcomer.num_computed_tokens = newcomer.num_tokens
    newcomer.token_ids.append(1)
    ids = decode_ids([seqs[0], newcomer])
    assert builder._rows.update(newcomer) == row and ids[1] not in first + trimmed
