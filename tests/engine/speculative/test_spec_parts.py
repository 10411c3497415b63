"""The pieces around the rule: config checks, n-gram lookup, metrics, adaptive K,
draft checks, and the engine hooks (scheduling proposals, trimming blocks)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.kv.budget import draft_memory
from pdserve.engine.models.arch import DUMMY_SHAPES
from pdserve.engine.models.registry import param_counts
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Sequence
from pdserve.engine.speculative.adaptive import (
    AdaptiveK,
    RelativeCosts,
    best_k,
    expected_speedup,
    expected_tokens_per_pass,
)
from pdserve.engine.speculative.draft_loading import check_draft
from pdserve.engine.speculative.ngram import lookup
from pdserve.engine.speculator import SpecMetrics


@pytest.mark.parametrize("k", [-1, 17, 100])
def test_k_outside_0_16_is_refused(k):
    with pytest.raises(ValueError, match=r"num_speculative_tokens \(K\) must be in \[0, 16\]"):
        SpecConfig(method="ngram", num_speculative_tokens=k)


@pytest.mark.parametrize("kwargs, message", [
    ({"method": "medusa"}, "method must be one of"),
    ({"method": "draft_model"}, "needs SpecConfig.draft_model"),
    ({"num_draft_layers": 0}, "num_draft_layers"),
    ({"ngram_min": 3, "ngram_max": 2}, "ngram_min <= ngram_max"),
    ({"method": "self_draft", "draft_vocab_size": 0}, "draft_vocab_size must be >= 1, got 0"),
    ({"method": "ngram", "draft_vocab_size": 1024}, "trim a draft model's head; method 'ngram' has none"),
])
def test_bad_spec_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpecConfig(**kwargs)


def test_k_zero_turns_speculation_off():
    assert SpecConfig(method="ngram", num_speculative_tokens=16).enabled
    assert not SpecConfig(method="ngram", num_speculative_tokens=0).enabled
    assert not SpecConfig().enabled


def test_ngram_lookup_copies_what_followed_the_latest_longest_match():
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
    assert lookup(tokens, 1, 3, 3) == [4, 5, 6]  # "1 2 3" last seen before 4 5 6
    assert lookup(tokens, 1, 3, 10) == [4, 5, 6, 7, 1, 2, 3]  # up to the end of the context
    assert lookup([5, 6, 7, 8], 1, 3, 2) == []
    assert lookup([4, 1, 7, 2, 1], 1, 3, 2) == [7, 2]  # falls back to shorter n-grams


def test_expected_tokens_formula():
    assert expected_tokens_per_pass(0.75, 4) == pytest.approx(3.05078125)
    assert expected_tokens_per_pass(1.0, 4) == 5
    assert expected_tokens_per_pass(0.0, 4) == 1
    assert expected_speedup(0.75, 4, 0.05) == pytest.approx(3.05078125 / 1.2)
    assert best_k(0.9, 16, 0.0) == 16
    assert best_k(0.1, 16, 0.5) == 0  # speculation does not pay


def test_metrics_count_passes_and_rejections():
    m = SpecMetrics()
    m.record(4, 4)
    m.record(4, 1)
    m.record(2, 0)
    assert (m.num_passes, m.num_proposed, m.num_accepted, m.num_rejections) == (3, 10, 5, 2)
    assert m.acceptance_rate == pytest.approx(0.5)
    assert m.alpha == pytest.approx(5 / 7)
    assert m.mean_accepted_length == pytest.approx(5 / 3)
    assert m.mean_tokens_per_pass == pytest.approx(8 / 3)


def test_adaptive_k_backs_off_and_probes():
    seqs = [Sequence("a", (1, 2), SamplingParams(), 16)]
    ada = AdaptiveK(max_k=8, costs=RelativeCosts(0.5), probe_interval=4)
    assert ada.k_for(seqs) > 0
    for _ in range(20):
        ada.update("a", 4, 4)
    assert ada.k_for(seqs) == 8
    for _ in range(20):
        ada.update("a", 4, 0)
    ks = [ada.k_for(seqs) for _ in range(16)]
    # A probe every 4 steps, then every 8 (a probe that finds nothing doubles the interval).
    assert ks == [0, 0, 0, 1] + [0] * 7 + [1] + [0] * 4
    for _ in range(20):
        ada.update("a", 4, 4)
    assert ada.k_for(seqs) > 0  # chosen again: the interval is back to 4
    for _ in range(20):
        ada.update("a", 4, 0)
    assert [ada.k_for(seqs) for _ in range(4)] == [0, 0, 0, 1]
    ada.forget("a")
    assert ada.alpha("a") == ada.overall_alpha()  # as a new request: from what the engine accepts


def test_one_unlucky_pass_at_a_requests_start_keeps_speculation_on():
    """A first proposal rejected at its first token is one judged token: the request's own
    estimate alone would read α = 0 and switch speculation off until the next probe."""
    seqs = [Sequence("a", (1, 2), SamplingParams(), 16)]
    ada = AdaptiveK(max_k=4, costs=RelativeCosts(0.3))  # speculation pays from α = 0.3
    for _ in range(2):  # 6% likely at α = 0.76, K = 4
        assert ada.k_for(seqs) > 0
        ada.update("a", 4, 0)
    assert 0.4 < ada.alpha("a") < ada.prior_alpha
    assert ada.k_for(seqs) > 0


class _Costs:
    """A device where verifying more tokens gets dear once the batch is large."""

    def step_ms(self, batch_size: int, k: int) -> float:
        return 10.0 + k * (0.5 if batch_size <= 8 else 20.0)


def test_adaptive_k_weighs_the_step_cost_of_this_batch_size():
    ada = AdaptiveK(max_k=4, costs=_Costs(), prior_alpha=0.8)
    small = [Sequence(str(i), (1,), SamplingParams(), 16) for i in range(4)]
    large = [Sequence(str(i), (1,), SamplingParams(), 16) for i in range(64)]
    assert ada.k_for(small) == 4  # (1 - 0.8^5) / 0.2 = 3.36 tokens for 12 ms, against 1 for 10
    assert ada.k_for(large) == 0  # 1.8 tokens for 30 ms at K = 1 does not beat 1 for 10
    # The requests' own α decides, not the prior: hopeless requests turn it off at any size.
    for s in small:
        for _ in range(30):
            ada.update(s.request_id, 4, 0)
    assert ada.k_for(small) == 0


def _tokenizer(vocab: dict[str, int]) -> SimpleNamespace:
    return SimpleNamespace(get_vocab=lambda: vocab)


def test_draft_checks():
    tiny, big = DUMMY_SHAPES["tiny"], DUMMY_SHAPES["llama-3.1-8b"]
    small = DUMMY_SHAPES["llama-3.2-1b"]
    check_draft(small, None, big, None, 4096)
    with pytest.raises(ValueError, match="vocabulary size 512 differs from the target's 128256"):
        check_draft(tiny, None, big, None, 4096)
    with pytest.raises(ValueError, match="larger than the target"):
        check_draft(big, None, small, None, 4096)
    with pytest.raises(ValueError, match="tokenizer differs"):
        check_draft(small, _tokenizer({"a": 0}), big, _tokenizer({"b": 0}), 4096)
    with pytest.raises(ValueError, match="both have a tokenizer"):
        check_draft(small, None, big, _tokenizer({"b": 0}), 4096)


BS = 4


def _decoding(sched: Scheduler, num_prompt: int, *rids: str) -> list[Sequence]:
    """Running sequences that have computed their prompts and sampled one token each."""
    seqs = [Sequence(rid, tuple(range(num_prompt)), SamplingParams(), BS) for rid in rids]
    for seq in seqs:
        sched.add(seq)
    assert sched.schedule().seqs == seqs
    for seq in seqs:
        seq.num_computed_tokens = num_prompt
        seq.token_ids.append(100)
    return seqs


def test_scheduler_verifies_proposals_within_budget():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=6), BlockManager(64, BS), 4096)
    a, b = _decoding(sched, 5, "a", "b")
    a.spec_token_ids[:] = [1, 2, 3, 4]
    b.spec_token_ids[:] = [1, 2, 3, 4]
    batch = sched.schedule()
    assert batch.num_new_tokens == [5, 1]  # a: last token + 4 proposals; b: only its last token fits
    assert a.spec_token_ids == [1, 2, 3, 4] and b.spec_token_ids == []
    assert len(a.block_ids) == 3  # slots for positions 5..9


def test_scheduler_drops_proposals_rather_than_preempting():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), BlockManager(4, BS), 4096)
    a, b = _decoding(sched, 4, "a", "b")  # one block each, two free
    a.spec_token_ids[:] = [1, 2, 3, 4, 5, 6, 7, 8]  # would take three more blocks
    batch = sched.schedule()
    assert batch.preempted == []
    assert batch.num_new_tokens == [1, 1] and a.spec_token_ids == []


def test_trim_frees_the_tail_blocks():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    seq = Sequence("a", tuple(range(3)), SamplingParams(), BS)
    assert bm.allocate(seq, 13)
    assert len(seq.block_ids) == 4
    bm.trim(seq, 5)
    assert len(seq.block_ids) == 2 and bm.num_free_blocks == 6
    bm.trim(seq, 5)
    assert len(seq.block_ids) == 2
    bm.free(seq)
    assert bm.num_free_blocks == 8


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_the_draft_is_counted_at_its_weights_dtype_and_with_a_copied_head(kv_cache_dtype):
    """A draft's weights are counted at the model's dtype (not the KV cache's), its KV at
    the cache's; a head of listed ids (a copy of those rows) adds its bytes, the first N
    ids (a view) add none."""
    target, draft = DUMMY_SHAPES["llama-3.1-8b"], DUMMY_SHAPES["llama-3.2-1b"]

    def memory(**spec):
        return draft_memory(EngineConfig(
            model=ModelConfig(source="dummy:llama-3.1-8b", device="cpu", dtype="bfloat16"),
            cache=CacheConfig(kv_cache_dtype=kv_cache_dtype),
            spec=SpecConfig(method="draft_model", draft_model="dummy:llama-3.2-1b", **spec)), target)

    kv_itemsize = 1 if kv_cache_dtype == "fp8" else 2
    plain = memory()
    assert plain.weight_bytes == param_counts(draft).total * 2
    assert plain.kv_bytes_per_block == 2 * draft.num_layers * 16 * draft.num_kv_heads * draft.head_dim * kv_itemsize
    assert memory(draft_vocab_size=32768) == plain
    listed = memory(draft_vocab_size=32768, draft_vocab_file="freq_32768.pt")
    assert listed.weight_bytes == plain.weight_bytes + 32768 * draft.hidden_size * 2
