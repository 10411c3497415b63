"""Overlapped steps (async scheduling) change when tokens are read back, never which:
the same workload gives the same tokens, finish reasons and free pool with it on and off."""

from __future__ import annotations

import pytest

from pdserve.engine.sampling import SamplingParams
from tests.engine.prompts import prompt_ids

pytestmark = pytest.mark.slow


def _workload(tokenizer) -> list[tuple[list[int], SamplingParams]]:
    shared = prompt_ids(tokenizer, 70, variant=3)  # a prefix several prompts share: prefix hits
    greedy = SamplingParams(temperature=0.0, max_tokens=20)
    return [
        (prompt_ids(tokenizer, 150, variant=0), greedy),  # chunked (the budget is 64 tokens)
        (shared + prompt_ids(tokenizer, 9, variant=4), greedy),
        (shared + prompt_ids(tokenizer, 30, variant=5), SamplingParams(temperature=0.0, max_tokens=1)),
        (prompt_ids(tokenizer, 12, variant=6), SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                                stop_token_ids=(13,))),
        (prompt_ids(tokenizer, 40, variant=7), SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=18)),
        (shared + prompt_ids(tokenizer, 20, variant=8), SamplingParams(temperature=0.0, max_tokens=16,
                                                                      stop_token_ids=(30, 198))),
        (prompt_ids(tokenizer, 5, variant=9), SamplingParams(temperature=0.0, max_tokens=2, logprobs=2)),
    ]


def _run(engine, workload) -> list[tuple]:
    """Staggered arrivals, one request aborted mid-way; every output and the pool afterwards."""
    ids = []
    outputs: dict[str, list] = {}
    reasons: dict[str, object] = {}
    pending = list(workload)
    steps = 0
    victim = engine.add_request(workload[0][0], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    while pending or engine.has_unfinished:
        for prompt, params in pending[:2]:
            ids.append(engine.add_request(prompt, params))
            outputs[ids[-1]] = []
        pending = pending[2:]
        for delta in engine.step():
            outputs.setdefault(delta.request_id, []).extend(
                (t, round(lp.logprob, 4)) if lp else t for t, lp in zip(delta.token_ids, delta.logprobs or
                                                                           [None] * len(delta.token_ids)))
            if delta.finished:
                reasons[delta.request_id] = delta.finish_reason
        steps += 1
        if steps == 6:
            assert engine.abort(victim)
    assert engine.block_manager.num_free_blocks + sum(
        1 for b in range(engine.block_manager.num_blocks) if engine.block_manager.ref_count(b)) == \
        engine.block_manager.num_blocks
    assert all(engine.block_manager.ref_count(b) == 0 for b in range(engine.block_manager.num_blocks))
    return [(outputs[i], reasons.get(i)) for i in ids]


@pytest.mark.parametrize("num_blocks", [None, 24])  # 24 blocks of 16: preemptions
def test_overlapped_steps_give_the_same_tokens(make_engine, tokenizer, num_blocks):
    workload = _workload(tokenizer)
    runs = {}
    for overlap in (False, True):
        engine = make_engine(num_blocks=num_blocks, max_num_batched_tokens=64, async_scheduling=overlap)
        runs[overlap] = _run(engine, workload)
        if num_blocks is not None:
            assert engine.scheduler.num_preemptions > 0
        assert engine.block_manager.num_prefix_hits > 0
    assert runs[True] == runs[False]
    assert all(reason is not None for _, reason in runs[True])
    assert [len(toks) for toks, _ in runs[True]][2] == 1  # max_tokens=1: exactly one, never a wasted extra
