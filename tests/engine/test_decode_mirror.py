"""The CPU decode steps' kept context (engine.attention.decode_mirror) against a fresh gather of
the same step: equal outputs through appends, a block boundary, a reordered batch, a sequence
replaced by another over the very same blocks and length, and a context that outgrows its room."""

from __future__ import annotations

import torch

from pdserve.engine.attention.base import AttentionMetadata
from pdserve.engine.attention.torch_ref import TorchAttention
from pdserve.engine.kv.pool import KVLayout, KVPool

BS, HKV, HQ, D, LAYERS = 4, 2, 4, 8, 2


def _meta(tables: list[list[int]], lens: list[int], ids: tuple[int, ...]) -> AttentionMetadata:
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    slots = [t[(n - 1) // BS] * BS + (n - 1) % BS for t, n in zip(tables, lens)]
    empty = torch.zeros(0, dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64), num_decodes=len(lens), decode_block_tables=table,
        decode_seq_lens=torch.tensor(lens, dtype=torch.int32), prefill_cu_seqlens_q=torch.zeros(1, dtype=torch.int32),
        prefill_seq_lens=empty, prefill_block_tables=table[:0], prefill_max_seqlen_q=0, decode_seq_lens_host=list(lens),
        prefill_q_lens_host=[], prefill_seq_lens_host=[], decode_table_ids=ids)


def _step(attn: TorchAttention, pool: KVPool, meta: AttentionMetadata, qkv: list[tuple[torch.Tensor, ...]]) -> list:
    step = attn.begin_step(meta, pool, D ** -0.5)
    return [step(layer, q, k, v, lambda q, k: (q, k)) for layer, (q, k, v) in enumerate(qkv)]


def test_kept_context_attends_as_a_fresh_gather():
    gen = torch.Generator().manual_seed(0)
    layout = KVLayout("t", torch.float32, LAYERS, HKV, D, BS)
    pool, ref_pool = KVPool(layout, 512, "cpu"), KVPool(layout, 512, "cpu")
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen))
    ref_pool.kv.copy_(pool.kv)
    attn = TorchAttention()
    tables, lens, ids = [[0, 1, 2], [3, 4]], [9, 5], (1, 2)
    appended = []

    def run() -> None:
        meta = _meta(tables, lens, ids)
        qkv = [(torch.randn(len(lens), HQ, D, generator=gen), torch.randn(len(lens), HKV, D, generator=gen),
                torch.randn(len(lens), HKV, D, generator=gen)) for _ in range(LAYERS)]
        got = _step(attn, pool, meta, qkv)
        appended.append(attn.mirror._appending)
        want = _step(TorchAttention(), ref_pool, meta, qkv)  # no history: gathers
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(pool.kv, ref_pool.kv, rtol=0, atol=0)

    free = iter(range(10, 512))

    def grow() -> None:
        for i, t in enumerate(tables):
            lens[i] += 1
            if lens[i] > BS * len(t):
                t.append(next(free))

    run()
    for _ in range(6):  # appends, across block boundaries
        grow()
        run()
    assert appended == [False] + [True] * 6
    tables.reverse(), lens.reverse()  # a reordered batch: gathered afresh
    ids = ids[::-1]
    grow()
    run()
    grow()
    run()
    assert appended[-2:] == [False, True]
    # Another sequence in the second row over the same blocks, one token longer, its KV
    # rewritten: only its table id tells it apart.
    for entry in (pool.kv, ref_pool.kv):
        entry[:, :, torch.tensor(tables[1])] = 0.5
    ids = (ids[0], 99)
    grow()
    run()
    assert appended[-1] is False
    for _ in range(40):  # past the room a fresh gather left
        grow()
        run()
    assert False in appended[-40:] and appended[-1] is True


def test_a_mirror_over_the_budget_gathers_every_step():
    layout = KVLayout("t", torch.float32, LAYERS, HKV, D, BS)
    pool = KVPool(layout, 8, "cpu")
    attn = TorchAttention()
    meta = _meta([[0, 1, 2, 3], [4, 5, 6, 7]], [16, 16], (1, 2))
    assert not attn.mirror.begin(meta, pool)  # 2 rows of 8 blocks of room: the whole pool
