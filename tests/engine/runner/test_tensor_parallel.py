"""Tensor parallelism on the CPU (gloo): a tiny random model split over 2 and 4 processes
gives the greedy tokens of Hugging Face transformers and of one rank, through chunked
prefill and preemption; the shard plan splits what it should and refuses what it cannot."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig, SpecConfig
from pdserve.engine.engine import Engine
from pdserve.engine.models.arch import DUMMY_SHAPES
from pdserve.engine.models.parallel import ShardPlan
from pdserve.engine.sampling import SamplingParams
from tests.engine.hf_reference import assert_matches_reference, hf_greedy

pytestmark = pytest.mark.slow

# 4 query heads over 2 KV heads (GQA): at TP 4 each KV head is replicated on two ranks.
# A vocabulary of 250 does not divide by 4: the last rank's slice is padded. o_proj has a
# bias (row-parallel: added once).
TINY = dict(vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3, eos_token_id=None)
PROMPT_LENGTHS = (3, 40, 200, 120, 77, 9)
NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(LlamaConfig(**TINY, tie_word_embeddings=False, attention_bias=True),
                                          dtype=torch.float32).eval()
    folder = tmp_path_factory.mktemp("tiny-llama")
    hf.save_pretrained(str(folder))
    return hf, folder


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 250, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def make_engine(folder, tp: int, **cache) -> Engine:
    return Engine(EngineConfig(model=ModelConfig(source=str(folder), device="cpu", dtype="float32"),
                               cache=CacheConfig(**cache), scheduler=SchedulerConfig(max_num_batched_tokens=64),
                               parallel=ParallelConfig(tensor_parallel_size=tp)))


def run_staggered(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    """Two arrivals a step: a continuous batch of decodes and prompt chunks."""
    out: dict[str, list[int]] = {}
    ids, pending = [], list(prompts)
    while pending or engine.has_unfinished:
        for p in pending[:2]:
            ids.append(engine.add_request(p, GREEDY))
            out[ids[-1]] = []
        pending = pending[2:]
        for delta in engine.step():
            out[delta.request_id].extend(delta.token_ids)
    return [out[i] for i in ids]


@pytest.fixture(scope="module")
def one_rank(llama, prompts) -> list[list[int]]:
    engine = make_engine(llama[1], 1)
    return run_staggered(engine, prompts)


@pytest.mark.parametrize("tp", [2, 4])
def test_greedy_matches_hf_and_one_rank_through_preemption(llama, prompts, one_rank, tp):
    hf, folder = llama
    # 24 blocks of 16 = 384 slots: the longest request (224 tokens) fits, all six together do not.
    engine = make_engine(folder, tp, num_blocks=24)
    try:
        assert engine.pool.layout.num_kv_heads == (1 if tp >= 2 else 2)
        got = run_staggered(engine, prompts)
        assert engine.scheduler.num_preemptions > 0, "the pool was meant to be too small: no preemption happened"
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        engine.close()
    assert got == one_rank, f"TP {tp} differs from one rank"
    for prompt, tokens in zip(prompts, got):
        want, logits = hf_greedy(hf, prompt, NEW_TOKENS)
        assert_matches_reference(tokens, want, logits, f"TP {tp}, prompt of {len(prompt)}")
    assert not engine.ranks.processes[0].is_alive(), "close() left a rank running"


def test_tied_embeddings_and_qkv_bias_split(tmp_path, prompts):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(Qwen2Config(**TINY, tie_word_embeddings=True), dtype=torch.float32).eval()
    hf.save_pretrained(str(tmp_path))
    engine = make_engine(tmp_path, 2)
    try:
        outs = engine.generate(prompts[:3], GREEDY)
    finally:
        engine.close()
    for prompt, out in zip(prompts, outs):
        want, logits = hf_greedy(hf, prompt, NEW_TOKENS)
        assert_matches_reference(out.token_ids, want, logits, f"qwen2 TP 2, prompt of {len(prompt)}")


def test_a_dead_rank_fails_the_next_step_by_name(llama):
    engine = make_engine(llama[1], 2)
    try:
        assert engine.generate([[5, 6, 7]], GREEDY)[0].token_ids
        proc = engine.ranks.processes[0]
        proc.kill()
        proc.join(10)
        engine.add_request([5, 6, 7], GREEDY)
        with pytest.raises(RuntimeError, match="tensor-parallel rank 1"):
            while engine.has_unfinished:
                engine.step()
    finally:
        engine.close()


def test_shard_plan_splits_heads_mlp_and_vocabulary():
    arch = DUMMY_SHAPES["llama-3.1-8b"]  # 32 heads, 8 KV heads, vocabulary 128,256
    plans = [ShardPlan.of(arch, r, 2) for r in range(2)]
    assert [(p.num_heads, p.num_kv_heads, p.kv_head_start) for p in plans] == [(16, 4, 0), (16, 4, 4)]
    assert [p.intermediate_size for p in plans] == [7168, 7168]
    assert [(p.vocab_start, p.vocab_rows) for p in plans] == [(0, 64128), (64128, 64128)]
    # 16 ranks over 8 KV heads: each KV head on two ranks, the one their query heads read.
    wide = [ShardPlan.of(arch, r, 16) for r in range(16)]
    assert [p.kv_head_start for p in wide] == [r // 2 for r in range(16)]
    assert all(p.num_kv_heads == 1 and p.num_heads == 2 for p in wide)
    for r, p in enumerate(wide):
        first_q = r * p.num_heads
        assert first_q // (arch.num_heads // arch.num_kv_heads) == p.kv_head_start


@pytest.mark.parametrize("size, match", [(3, "32 attention heads"), (64, "attention heads"), (0, ">= 1")])
def test_shard_plan_refuses_what_does_not_split(size, match):
    with pytest.raises(ValueError, match=match):
        ShardPlan.of(DUMMY_SHAPES["llama-3.1-8b"], 0, size)


def test_speculation_with_tensor_parallelism_is_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(spec=SpecConfig(method="ngram"), parallel=ParallelConfig(tensor_parallel_size=2))
