"""Qwen3 and the Mixture-of-Experts families (Mixtral, Qwen3-MoE, Qwen2-MoE with a shared
expert) against transformers, on tiny random models built with transformers' own classes
and saved as folders (what `save_pretrained` writes: per-expert tensors).

Each family runs as a continuous batch with chunked prefill, a shared prefix (cache hits)
and a pool too small for every request at once (preemption): greedy tokens identical to HF
`generate`, each token's log-probability within float32 tolerance of HF's. Then: a
checkpoint with the fused 3-D expert layout loads the same model, dummy weights of an MoE
shape run, an FP8 KV pool holds HF's K/V rounded, what pdserve does not implement is refused
by name, and tensor parallelism (2 ranks, gloo) and expert parallelism (2 ranks) give one
rank's tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine.config import CacheConfig, ParallelConfig, SchedulerConfig
from pdserve.engine.models.registry import param_counts
from pdserve.engine.sampling import SamplingParams
from tests.engine.families import cpu_engine, family_prompts
from tests.engine.hf_reference import assert_matches_reference, fp8_pool_steps, hf_greedy

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3, eos_token_id=None)
NEW_TOKENS = 16


def qwen3():
    from transformers import Qwen3Config

    return Qwen3Config(**TINY, head_dim=16, tie_word_embeddings=True)


def qwen3_moe():
    from transformers import Qwen3MoeConfig

    # Layer 1 dense (mlp_only_layers), 8 experts, top 2 renormalized.
    return Qwen3MoeConfig(**TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                          norm_topk_prob=True, mlp_only_layers=[1])


def mixtral():
    from transformers import MixtralConfig

    return MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2)


def qwen2_moe():
    from transformers import Qwen2MoeConfig

    # A shared expert behind a sigmoid gate, top-k weights not renormalized.
    return Qwen2MoeConfig(**TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                          shared_expert_intermediate_size=48, norm_topk_prob=False)


FAMILIES = [qwen3, qwen3_moe, mixtral, qwen2_moe]


def _saved(make_config, folder: Path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(make_config(), dtype=torch.float32).eval()
    hf.save_pretrained(str(folder))
    return hf


@pytest.mark.parametrize("make_config", FAMILIES)
def test_greedy_and_logprobs_match_hf_with_chunks_prefix_hits_and_preemption(make_config, tmp_path):
    hf = _saved(make_config, tmp_path)
    # 12 blocks of 16 slots: the two longest requests (146 and 81 tokens with their
    # answers) do not fit beside each other; chunks of 32 tokens.
    engine = cpu_engine(tmp_path, cache=CacheConfig(num_blocks=12),
                     scheduler=SchedulerConfig(max_num_batched_tokens=32))
    prompts = family_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    ids = [engine.add_request(p, params) for p in prompts]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    logprobs: dict[str, list[float]] = {i: [] for i in ids}
    while engine.has_unfinished:
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.token_ids)
            logprobs[delta.request_id].extend(lp.logprob for lp in delta.logprobs)
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to be too small: nothing was preempted"
    assert engine.block_manager.num_prefix_hits >= 2 * 32, "the shared 40-token prefix was not reused"
    for prompt, rid in zip(prompts, ids):
        want, logits = hf_greedy(hf, prompt, NEW_TOKENS)
        what = f"{make_config.__name__}, prompt of {len(prompt)}"
        assert_matches_reference(tokens[rid], want, logits, what)
        hf_logprobs = torch.log_softmax(logits, dim=-1)[torch.arange(len(want)), torch.tensor(want)]
        torch.testing.assert_close(torch.tensor(logprobs[rid]), hf_logprobs, atol=1e-4, rtol=1e-4, msg=what)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("make_config", [qwen3_moe, mixtral])
def test_an_fp8_kv_cache_holds_what_hf_computes_with_its_kv_rounded(make_config, tmp_path):
    """An MoE model over an FP8 KV pool (chunked prefill, then decodes): the pool holds the
    K/V HF computes with its cache rounded to e4m3 as they enter it. The first chunk is one
    forward in both: equal; after it the float32 sums run in another order and a value on a
    rounding boundary may round the other way (tests/engine/test_fp8_kv.py): within one
    e4m3 step."""
    hf = _saved(make_config, tmp_path)
    chunk = 32
    engine = cpu_engine(tmp_path, cache=CacheConfig(num_blocks=16, enable_prefix_caching=False, kv_cache_dtype="fp8"),
                     scheduler=SchedulerConfig(max_num_batched_tokens=chunk, async_scheduling=False))
    assert engine.pool.kv.dtype == torch.float8_e4m3fn
    engine.add_request(family_prompts()[2], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    while not engine.scheduler.running or engine.scheduler.running[0].num_output_tokens < NEW_TOKENS // 2:
        engine.step()
    seq = engine.scheduler.running[0]
    for i, steps in enumerate(fp8_pool_steps(engine, seq, hf)):
        layer = i // 2
        assert float((steps[:chunk] == 0).float().mean()) >= 0.999, f"layer {layer}: the first chunk differs"
        assert float((steps <= 1).float().mean()) >= 0.99, f"layer {layer}"
    engine.abort(seq.request_id)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_fused_expert_checkpoint_loads_the_same_model(tmp_path):
    """transformers 5 holds each layer's experts as two 3-D tensors; a checkpoint written
    that way (safetensors directly) gives the per-expert checkpoint's tokens."""
    from safetensors.torch import load_file, save_file

    per_expert = tmp_path / "per-expert"
    _saved(qwen3_moe, per_expert)
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((per_expert / "config.json").read_text())
    tensors = load_file(str(per_expert / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if ".experts." not in name:
            out[name] = t
    for layer in (0,):  # layer 1 is dense (mlp_only_layers)
        p = f"model.layers.{layer}.mlp.experts."
        out[p + "gate_up_proj"] = torch.stack([torch.cat([tensors[f"{p}{e}.gate_proj.weight"],
                                                          tensors[f"{p}{e}.up_proj.weight"]]) for e in range(8)])
        out[p + "down_proj"] = torch.stack([tensors[f"{p}{e}.down_proj.weight"] for e in range(8)])
    save_file(out, str(fused / "model.safetensors"))
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = family_prompts()
    want = [o.token_ids for o in cpu_engine(per_expert).generate(prompts, params)]
    assert [o.token_ids for o in cpu_engine(fused).generate(prompts, params)] == want


def test_dummy_moe_weights_run_and_count_active_parameters():
    engine = cpu_engine("dummy:tiny-moe")
    out = engine.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
    counts = param_counts(engine.arch)
    assert counts.total == sum(p.numel() for p in engine.model.parameters())
    moe = engine.arch.moe
    experts = engine.arch.num_layers * moe.num_experts * 3 * moe.intermediate_size * engine.arch.hidden_size
    assert counts.total - counts.active == experts * (moe.num_experts - moe.top_k) // moe.num_experts


@pytest.mark.parametrize(("field", "value", "match"), [
    ("model_type", "phi3", "unsupported model_type 'phi3'"),
    ("hidden_act", "gelu", "hidden_act 'gelu'"),
    ("use_sliding_window", True, "sliding-window"),
])
def test_what_is_not_implemented_is_refused_by_name(tmp_path, field, value, match):
    import json

    _saved(qwen3, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config[field] = value
    if field == "use_sliding_window":
        config["sliding_window"] = 64
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        cpu_engine(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("make_config", [qwen3_moe, qwen2_moe])
def test_tensor_and_expert_parallel_give_one_ranks_tokens(make_config, tmp_path):
    _saved(make_config, tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = family_prompts()
    want = [o.token_ids for o in cpu_engine(tmp_path).generate(prompts, params)]
    for expert_parallel in (False, True):
        engine = cpu_engine(tmp_path, parallel=ParallelConfig(tensor_parallel_size=2,
                                                           enable_expert_parallel=expert_parallel))
        try:
            got = [o.token_ids for o in engine.generate(prompts, params)]
        finally:
            engine.close()
        assert got == want, f"expert_parallel={expert_parallel}"


def test_speculation_on_an_moe_target_keeps_greedy_output(tmp_path):
    """The self-draft (the MoE target's first layer) and a dense Qwen3 draft of the same
    vocabulary: greedy tokens as without speculation."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from pdserve.engine.config import SpecConfig

    target = tmp_path / "target"
    _saved(qwen3_moe, target)
    draft = tmp_path / "draft"
    torch.manual_seed(1)
    small = dict(TINY, num_hidden_layers=1, intermediate_size=16)
    AutoModelForCausalLM.from_config(Qwen3Config(**small, head_dim=16), dtype=torch.float32).save_pretrained(str(draft))
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = family_prompts()
    want = [o.token_ids for o in cpu_engine(target).generate(prompts, params)]
    for spec in (SpecConfig(method="self_draft", num_draft_layers=1, num_speculative_tokens=3),
                 SpecConfig(method="draft_model", draft_model=str(draft), num_speculative_tokens=3)):
        got = [o.token_ids for o in cpu_engine(target, spec=spec).generate(prompts, params)]
        assert got == want, spec.method


def test_structured_outputs_hold_on_an_moe_model(tmp_path, tokenizer):
    """A tiny Qwen3-MoE with the default model's tokenizer: every answer under each shared
    JSON schema follows it, greedy and sampled, and the grammar ends it; free answers of the
    same seeds follow none (a random model's text is not JSON)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from pdserve.engine.sampling import StructuredOutput
    from pdserve.engine.sequence import FinishReason
    from tests.engine.grammar_cases import MAX_TOKENS, SCHEMAS, validates

    torch.manual_seed(0)
    tiny = {**TINY, "vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id}
    config = Qwen3MoeConfig(**tiny, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                            norm_topk_prob=True)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(tmp_path))
    tokenizer.save_pretrained(str(tmp_path))
    engine = cpu_engine(tmp_path)
    prompt = tokenizer.encode("Describe a person as a JSON object.")
    cases = [(name, kwargs) for name in SCHEMAS for kwargs in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 7})]
    outs = engine.generate([prompt] * len(cases), [
        SamplingParams(max_tokens=MAX_TOKENS, structured=StructuredOutput.from_schema(SCHEMAS[name]), **kwargs)
        for name, kwargs in cases])
    for (name, kwargs), out in zip(cases, outs):
        assert validates(out.text, SCHEMAS[name]), (name, kwargs, out.text)
        assert out.finish_reason is FinishReason.STOP
    free = engine.generate([prompt], SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_TOKENS))[0]
    assert not any(validates(free.text, schema) for schema in SCHEMAS.values())
