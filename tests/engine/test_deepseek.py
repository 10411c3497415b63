"""DeepSeek-V2 and DeepSeek-V3 (multi-head latent attention over a latent KV pool,
DeepSeekMoE) against transformers, on tiny random models built with its own
`DeepseekV2Config` / `DeepseekV3Config` and saved as folders.

The four models between them cover every routing mode (V2 "greedy" and
"group_limited_greedy", V3 "noaux_tc" with a random non-zero `e_score_correction_bias`:
a fresh model's is zero, and a router that ignored it would pass), `q_lora_rank` set and
not, YaRN with `mscale_all_dim`, interleaved and half-split rotary pairs, dense first layers
and shared experts. Each runs as a continuous batch with chunked prefill, a shared prefix
(cache hits) and a pool too small for every request at once (preemption): greedy tokens
equal HF `generate`, log-probabilities within float32 tolerance. Then: a block-scaled FP8
checkpoint equals HF on its dequantized weights, tensor and expert parallelism (2 ranks,
gloo) give one rank's tokens, a checkpoint's MTP layers are skipped, what is not built is
refused by name, and the dummy shapes count their parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sampling import SamplingParams
from tests.engine.families import cpu_engine, family_prompts
from tests.engine.hf_reference import assert_matches_reference, hf_greedy

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=512, initializer_range=0.3, eos_token_id=None, kv_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32)
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "mscale": 1.0, "mscale_all_dim": 0.8,
        "beta_fast": 32, "beta_slow": 1}
NEW_TOKENS = 16


def v2_greedy(**overrides):
    from transformers import DeepseekV2Config

    # V2-Lite's router: softmax top-k, not renormalized; no q_lora_rank; a dense first layer.
    return DeepseekV2Config(**{**TINY, **dict(q_lora_rank=None, topk_method="greedy", n_shared_experts=2,
                                              first_k_dense_replace=1, routed_scaling_factor=1.5), **overrides})


def v2_grouped(**overrides):
    from transformers import DeepseekV2Config

    return DeepseekV2Config(**{**TINY, **dict(q_lora_rank=24, topk_method="group_limited_greedy", n_group=4,
                                              topk_group=2, n_shared_experts=1, first_k_dense_replace=0,
                                              rope_scaling=YARN), **overrides})


def v3(**overrides):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**{**TINY, **dict(q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True,
                                              routed_scaling_factor=2.5, n_shared_experts=1, first_k_dense_replace=1,
                                              rope_scaling=YARN), **overrides})


def v3_halves(**overrides):
    from transformers import DeepseekV3Config

    # Rotary halves (rope_interleave off), no q_lora_rank, one group, every layer MoE.
    return DeepseekV3Config(**{**TINY, **dict(q_lora_rank=None, n_group=1, topk_group=1, norm_topk_prob=False,
                                              routed_scaling_factor=1.0, n_shared_experts=2, first_k_dense_replace=0,
                                              rope_interleave=False), **overrides})


FAMILIES = [v2_greedy, v2_grouped, v3, v3_halves]


def _hf_model(config):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    for layer in hf.model.layers:
        bias = getattr(layer.mlp, "gate", None) and getattr(layer.mlp.gate, "e_score_correction_bias", None)
        if bias is not None:  # a fresh model's is zero: make the choice depend on it
            bias.normal_(0.0, 0.5)
    return hf


Reference = tuple[Path, dict[tuple[int, ...], tuple[list[int], torch.Tensor]]]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Callable[[Callable], Reference]:
    """make_config -> (its saved folder, HF's greedy answers to `family_prompts()`), each made
    once for the module: the HF runs are most of its time."""
    made: dict[Callable, Reference] = {}

    def get(make_config: Callable) -> Reference:
        if make_config not in made:
            hf = _hf_model(make_config())
            folder = tmp_path_factory.mktemp(make_config.__name__)
            hf.save_pretrained(str(folder))
            made[make_config] = folder, {tuple(p): hf_greedy(hf, p, NEW_TOKENS) for p in family_prompts()}
        return made[make_config]

    return get


def _run(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    ids = [engine.add_request(p, params) for p in prompts]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    logprobs: dict[str, list[float]] = {i: [] for i in ids}
    while engine.has_unfinished:
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.token_ids)
            logprobs[delta.request_id].extend(lp.logprob for lp in delta.logprobs)
    return [tokens[i] for i in ids], [logprobs[i] for i in ids]


def _assert_matches_hf(answers: dict, tokens: list[list[int]], logprobs: list[list[float]], what: str) -> None:
    for prompt, got, got_logprobs in zip(family_prompts(), tokens, logprobs):
        want, logits = answers[tuple(prompt)]
        where = f"{what}, prompt of {len(prompt)}"
        assert_matches_reference(got, want, logits, where)
        hf_logprobs = torch.log_softmax(logits, dim=-1)[torch.arange(len(want)), torch.tensor(want)]
        torch.testing.assert_close(torch.tensor(got_logprobs), hf_logprobs, atol=1e-4, rtol=1e-4, msg=where)


@pytest.mark.parametrize("make_config", FAMILIES)
def test_greedy_and_logprobs_match_hf_with_chunks_prefix_hits_and_preemption(make_config, reference):
    folder, answers = reference(make_config)
    # 12 blocks of 16 slots: the two longest requests (146 and 81 tokens with their
    # answers) do not fit beside each other; chunks of 32 tokens.
    engine = cpu_engine(folder, cache=CacheConfig(num_blocks=12), scheduler=SchedulerConfig(max_num_batched_tokens=32))
    layout = engine.pool.layout
    assert (layout.kind, layout.num_entries, layout.num_kv_heads, layout.head_dim) == ("mla", 1, 1, 32 + 8)
    # Interleaved rotary pairs are put in rotate-half order at load, in the weights' rows.
    attn = engine.model.layers[0].self_attn
    assert attn.rope_rows_deinterleaved == attn.mla.rope_interleave
    tokens, logprobs = _run(engine, family_prompts())
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to be too small: nothing was preempted"
    assert engine.block_manager.num_prefix_hits >= 2 * 32, "the shared 40-token prefix was not reused"
    _assert_matches_hf(answers, tokens, logprobs, make_config.__name__)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_block_scaled_fp8_checkpoint_equals_hf_on_its_dequantized_weights(tmp_path):
    """DeepSeek-V3's own format (quant_method "fp8", 128 x 128 `weight_scale_inv`) over every
    linear layer of the decoder, MLA's included; HF runs the dequantized weights. Widths of
    128 so that the fused gate/up halves start on a block."""
    from tests.engine import fp8_checkpoints as fp8c

    hf = _hf_model(v3(intermediate_size=128, moe_intermediate_size=128))
    layers = (*fp8c.LAYERS, "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
    fp8c.save_fp8_checkpoint(hf, tmp_path, "block", fp8c.FP8_BLOCK_CONFIG, "weight_scale_inv", layers=layers)
    engine = cpu_engine(tmp_path)
    assert engine.model.layers[0].self_attn.kv_b_proj.weight.dtype == torch.float8_e4m3fn
    prompts = family_prompts()[1:3]
    tokens, logprobs = _run(engine, prompts)
    for prompt, got, got_logprobs in zip(prompts, tokens, logprobs):
        want, logits = hf_greedy(hf, prompt, NEW_TOKENS)
        assert_matches_reference(got, want, logits, f"fp8, prompt of {len(prompt)}")
        hf_logprobs = torch.log_softmax(logits, dim=-1)[torch.arange(len(want)), torch.tensor(want)]
        torch.testing.assert_close(torch.tensor(got_logprobs), hf_logprobs, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_tensor_and_expert_parallel_give_one_ranks_tokens(reference):
    """Heads split over 2 ranks, the latent pool whole on each; the experts sliced (tensor
    parallel) or whole, 4 a rank (expert parallel): HF's tokens, as one rank gives them."""
    folder, answers = reference(v3)
    for expert_parallel in (False, True):
        parallel = ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=expert_parallel)
        engine = cpu_engine(folder, parallel=parallel)
        try:
            # every rank holds the whole latent: the wire's layout, sent once
            assert dataclasses.replace(engine.pool.layout, tp_size=1) == engine.kv_wire_layout
            assert [(kv.shape, start) for kv, start in engine.kv_shards] == [(engine.pool.kv.shape, 0)] * 2
            tokens, logprobs = _run(engine, family_prompts())
        finally:
            engine.close()
        _assert_matches_hf(answers, tokens, logprobs, f"expert_parallel={expert_parallel}")


def test_speculation_on_a_deepseek_target_keeps_greedy_output(reference):
    """Verification steps (K + 1 new tokens a sequence after its context: the latents
    expanded) and a self-draft over a latent pool of its own: HF's greedy tokens."""
    from pdserve.engine.config import SpecConfig

    folder, answers = reference(v3)
    prompts = family_prompts()
    for spec in (SpecConfig(method="self_draft", num_draft_layers=1, num_speculative_tokens=3),
                 SpecConfig(method="ngram", num_speculative_tokens=3)):
        engine = cpu_engine(folder, spec=spec)
        tokens, logprobs = _run(engine, prompts)
        assert engine.speculator is not None and engine.speculator.metrics.num_proposed > 0, spec.method
        _assert_matches_hf(answers, tokens, logprobs, spec.method)


def test_the_load_names_the_latent_layout_and_its_bytes_a_token(reference):
    """What `pdserve info` shows of a worker (EngineLoad): an "mla" layout, a token's latent
    (kv_lora_rank + qk_rope_head_dim values) in every layer, float32; half that in FP8."""
    folder, _ = reference(v3)
    latent = TINY["kv_lora_rank"] + TINY["qk_rope_head_dim"]
    for kv_cache_dtype, size in (("auto", 4), ("fp8", 1)):
        load = cpu_engine(folder, cache=CacheConfig(kv_cache_dtype=kv_cache_dtype)).load()
        assert (load.kv_layout, load.kv_bytes_per_token) == ("mla", TINY["num_hidden_layers"] * latent * size)


def test_an_fp8_latent_cache_holds_the_latents_rounded(reference):
    """kv_cache_dtype "fp8" over a latent pool: after one prompt's prefill (its one token
    sampled, none fed back), layer 0's rows (the same forward either way up to there) are
    the float pool's rounded to e4m3."""
    from pdserve.kernels import fp8

    folder, _ = reference(v3_halves)
    prompt = family_prompts()[1]
    pools = {}
    for dtype in ("auto", "fp8"):
        engine = cpu_engine(folder, cache=CacheConfig(num_blocks=16, kv_cache_dtype=dtype))
        engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        pools[dtype] = engine.pool
    assert pools["fp8"].kv.dtype == fp8.KV_FP8
    # Both pools placed the tokens alike; layer 0's rows, all of them (unwritten ones zero in both).
    want = fp8.quantize(pools["auto"].latent(0))
    assert int(want.float().ne(0).any(-1).sum()) == len(prompt)
    assert torch.equal(pools["fp8"].latent(0).view(torch.uint8), want.view(torch.uint8))


def test_a_checkpoints_mtp_layers_are_skipped(tmp_path, reference):
    """V3's checkpoints hold the multi-token-prediction module as `model.layers.{N}.*`
    (N = num_hidden_layers); like transformers, the model loads without it."""
    from safetensors.torch import load_file, save_file

    folder, answers = reference(v3_halves)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors |= {f"model.layers.2.{name.removeprefix('model.layers.1.')}": t.clone()
                for name, t in tensors.items() if name.startswith("model.layers.1.")}
    tensors["model.layers.2.eh_proj.weight"] = torch.randn(64, 128)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    prompt = family_prompts()[3]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    assert cpu_engine(tmp_path).generate([prompt], params)[0].token_ids == answers[tuple(prompt)][0]


@pytest.mark.parametrize(("make_config", "overrides", "match"), [
    (v3, {"topk_method": "greedy"}, "topk_method 'greedy'"),
    (v2_greedy, {"topk_method": "noaux_tc"}, "topk_method 'noaux_tc'"),
    (v3, {"scoring_func": "softmax"}, "scoring_func 'softmax'"),
    (v2_greedy, {"scoring_func": "sigmoid"}, "scoring_func 'sigmoid'"),
    (v2_greedy, {"moe_layer_freq": 2}, "moe_layer_freq 2"),
    (v2_greedy, {"norm_topk_prob": True}, "norm_topk_prob"),
    (v3, {"attention_bias": True}, "attention_bias"),
    (v3, {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    (v3, {"n_group": 3}, "n_group 3"),
    (v3, {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
])
def test_what_is_not_built_is_refused_by_name(make_config, overrides, match):
    from pdserve.engine.models.registry import arch_of

    with pytest.raises(ValueError, match=match):
        arch_of(make_config(**overrides))


def test_the_cuda_backends_mla_step_matches_hf_through_the_triton_interpreter(tmp_path):
    """The Triton backend's MLA step (`kernels.mla_decode` absorbed for decodes,
    `kernels.mla_prefill` over the gathered, expanded latents for a chunk after a cached
    prefix), run on the CPU by Triton's interpreter (tests/conftest.py sets it) with widths
    the kernels take: HF's tokens, through a prefix hit and a chunk after context."""
    from pdserve.engine.attention.triton_backend import TritonAttention

    hf = _hf_model(v3(qk_rope_head_dim=16, v_head_dim=16))
    hf.save_pretrained(str(tmp_path))
    engine = cpu_engine(tmp_path, cache=CacheConfig(num_blocks=16),
                        scheduler=SchedulerConfig(max_num_batched_tokens=16))
    engine.runner.executor.backend = TritonAttention(torch.float32)
    prefix = list(range(10, 30))
    prompts = [prefix + [3, 4], prefix + list(range(40, 55))]
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert engine.block_manager.num_prefix_hits == 16
    for prompt, out in zip(prompts, outs):
        want, logits = hf_greedy(hf, prompt, 5)
        assert_matches_reference(out.token_ids, want, logits, f"prompt of {len(prompt)}")


@pytest.mark.parametrize("make_config", [v3, v2_grouped])
def test_the_cuda_routing_kernel_routes_as_hfs_gate_through_the_triton_interpreter(make_config, tmp_path):
    """The engine's loaded router (its float32 gate and V3's non-zero `e_score_correction_bias`)
    with its routing fused as on CUDA (`kernels.moe_routing.grouped_topk_route`, run by
    Triton's interpreter): HF's gate's experts and weights for 1 and 150 tokens."""
    from pdserve.engine.models.deepseek import DeepseekMoE

    hf = _hf_model(make_config(n_routed_experts=16, num_experts_per_tok=3))
    hf.save_pretrained(str(tmp_path))
    model = cpu_engine(tmp_path, cache=CacheConfig(num_blocks=16)).runner.model
    layer = next(i for i, m in enumerate(model.layers) if isinstance(m.mlp, DeepseekMoE))
    hf_gate, gate = hf.model.layers[layer].mlp.gate, model.layers[layer].mlp.gate
    if make_config is v3:
        assert gate.e_score_correction_bias.abs().min() > 0
    for num_tokens in (1, 150):
        x = torch.randn(num_tokens, 64, generator=torch.Generator().manual_seed(num_tokens))
        with torch.no_grad():
            _, want_w, want_ids = hf_gate(x)
            weights, ids = gate(x, fused=True)
        want_ids, order = want_ids.sort(dim=-1)
        ids, mine = ids.sort(dim=-1)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(weights.gather(1, mine), want_w.gather(1, order), rtol=2e-6, atol=1e-7)


def test_dummy_shapes_count_their_parameters_and_keep_their_dense_layers():
    from pdserve.engine.models.registry import param_counts
    from pdserve.engine.models.weights import resolve_model

    v3_arch = resolve_model(ModelConfig(source="dummy:deepseek-v3")).arch
    counts = param_counts(v3_arch)
    assert abs(counts.total / 671e9 - 1) < 0.005 and abs(counts.active / 37e9 - 1) < 0.03  # DeepSeek's figures
    lite = param_counts(resolve_model(ModelConfig(source="dummy:deepseek-v2-lite")).arch)
    assert abs(lite.total / 15.7e9 - 1) < 0.005
    five = resolve_model(ModelConfig(source="dummy:deepseek-v3:layers=5")).arch
    assert five.num_layers == 5 and [five.moe.is_moe_layer(i) for i in range(5)] == [False] * 3 + [True] * 2
    assert five.kv_values_per_token == 512 + 64  # 61 layers: 70 KB a token in bf16
    with pytest.raises(ValueError, match="layers=<N>"):
        resolve_model(ModelConfig(source="dummy:deepseek-v3:depth=5"))


@pytest.mark.gpu
@pytest.mark.parametrize("make_config", [v2_greedy, v2_grouped, v3])
def test_on_cuda_the_mla_kernels_match_hf(make_config, tmp_path):
    """On the GPU (`kernels.mla_decode` for decodes, `kernels.mla_prefill` over the gathered
    latents for chunks after a cached prefix), float32, widths the kernels take (powers of
    two): HF's tokens on the same GPU, through chunked prefill and prefix hits."""
    hf = _hf_model(make_config(qk_rope_head_dim=16, v_head_dim=16))
    hf.save_pretrained(str(tmp_path))
    hf = hf.cuda()
    torch.backends.cuda.matmul.allow_tf32 = False
    engine = Engine(EngineConfig(model=ModelConfig(source=str(tmp_path), device="cuda", dtype="float32"),
                                 cache=CacheConfig(num_blocks=64),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=32)))
    prompts = family_prompts() + [list(range(1, 200))]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for prompt, out in zip(prompts, engine.generate(prompts, params)):
        want, logits = hf_greedy(hf, prompt, NEW_TOKENS)
        assert_matches_reference(out.token_ids, want, logits.cpu(), f"{make_config.__name__}, prompt of {len(prompt)}")
    assert engine.block_manager.num_prefix_hits > 0
    assert engine.runner.graphs is not None and engine.runner.graphs.num_replays.get(1, 0) > 0  # decodes replayed


@pytest.mark.gpu
@pytest.mark.parametrize("make_config", [v2_greedy, v3])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_on_cuda_mla_steps_replayed_from_graphs_give_the_eager_tokens(make_config, kv_cache_dtype, tmp_path):
    """Over a latent pool, decode steps and n-gram verification steps (K + 1 = 4 tokens a
    sequence, absorbed) replayed from CUDA graphs, padded to their buckets, give the tokens
    and log-probabilities of the same steps run eagerly (float32; an FP8 latent cache too),
    with and without speculation."""
    from pdserve.engine.config import SpecConfig

    _hf_model(make_config(qk_rope_head_dim=16, v_head_dim=16)).save_pretrained(str(tmp_path))
    gen = torch.Generator().manual_seed(3)
    # Repetitive prompts, so that the n-gram drafter proposes; 3 sequences pad a bucket of 4.
    prompts = [(torch.randint(3, 250, (n,), generator=gen).tolist() * 3)[:3 * n] for n in (5, 30, 90)]
    results = {}
    for eager in (True, False):
        for spec in (SpecConfig(), SpecConfig(method="ngram", num_speculative_tokens=3)):
            engine = Engine(EngineConfig(
                model=ModelConfig(source=str(tmp_path), device="cuda", dtype="float32", enforce_eager=eager),
                cache=CacheConfig(num_blocks=128, kv_cache_dtype=kv_cache_dtype), spec=spec))
            results[eager, spec.method] = _run(engine, prompts)
            if eager:
                assert engine.runner.graphs is None
                continue
            replays = engine.runner.graphs.num_replays
            assert replays.get(1, 0) > 0, replays
            if spec.enabled:
                assert engine.speculator.metrics.num_proposed > 0
                assert sum(n for q, n in replays.items() if q > 1) > 0, replays  # verifications replayed
    for method in ("none", "ngram"):
        (want, want_lp), (got, got_lp) = results[True, method], results[False, method]
        assert got == want, method
        torch.testing.assert_close(torch.tensor(got_lp), torch.tensor(want_lp), atol=1e-4, rtol=1e-4,
                                   msg=lambda m, method=method: f"{method}: {m}")
    assert results[False, "ngram"][0] == results[False, "none"][0]  # speculation keeps greedy output
