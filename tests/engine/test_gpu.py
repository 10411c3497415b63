"""The engine on CUDA (Triton kernels, CUDA-graph decode) against transformers on the same GPU.

Tiny random models are built on the spot (no download), with the head dims the
kernels serve (64 and 128), GQA, and prompts long enough for chunked prefill
and prefix hits. Run on a GPU machine: `pytest -m gpu tests/engine/test_gpu.py`.
"""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sampling import SamplingParams
from tests.engine.families import family_prompts
from tests.engine.hf_reference import assert_matches_reference, hf_greedy

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("head_dim, heads, kv_heads", [(64, 8, 2), (128, 8, 8), (128, 16, 2)])
def test_cuda_engine_matches_hf(tmp_path, head_dim, heads, kv_heads):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=heads * head_dim, intermediate_size=1024, num_hidden_layers=3,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         max_position_embeddings=4096, initializer_range=0.2, eos_token_id=None)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.save_pretrained(str(tmp_path))
    hf = hf.cuda()
    torch.backends.cuda.matmul.allow_tf32 = False
    engine = Engine(EngineConfig(model=ModelConfig(source=str(tmp_path), device="cuda", dtype="float32"),
                                 cache=CacheConfig(num_blocks=512),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=512)))
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, 1000, (100,), generator=gen).tolist()
    prompts = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (1, 15, 16, 17, 300, 900)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = engine.generate(prompts + [prefix + [5, 6, 7]], params)
    prompts += [prefix + [5, 6, 7], prefix + [8]]
    outs += engine.generate([prefix + [8]], params)  # its first 96 tokens come from the prefix cache
    for prompt, out in zip(prompts, outs):
        want, logits = hf_greedy(hf, prompt, 32)
        assert_matches_reference(out.token_ids, want, logits.cpu(), f"head_dim {head_dim}, prompt {len(prompt)}")
    assert engine.block_manager.num_prefix_hits > 0
    assert engine.runner.graphs is not None  # the decode steps above replayed CUDA graphs


def test_fp8_attention_dot_engine_runs_and_is_deterministic():
    """`CacheConfig.fp8_attention_dot` reaches the Triton backend, and an engine serves with it
    (CUDA-graph decode steps included)."""
    config = EngineConfig(model=ModelConfig(source="dummy:llama-3.2-1b", device="cuda", max_model_len=4096),
                          cache=CacheConfig(num_blocks=2048, enable_prefix_caching=False, kv_cache_dtype="fp8",
                                            fp8_attention_dot=True))
    engine = Engine(config)
    assert engine.runner.executor.backend.fp8_dot
    prompts = [[1 + i] * (50 + 40 * i) for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    first = [o.token_ids for o in engine.generate(prompts, params)]
    assert first == [o.token_ids for o in engine.generate(prompts, params)]
    assert all(len(t) == 16 for t in first)


def test_bf16_dummy_llama_runs_and_is_deterministic():
    config = EngineConfig(model=ModelConfig(source="dummy:llama-3.2-1b", device="cuda", max_model_len=4096),
                          cache=CacheConfig(num_blocks=2048, enable_prefix_caching=False))
    engine = Engine(config)
    prompts = [[1 + i] * (50 + 40 * i) for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    first = [o.token_ids for o in engine.generate(prompts, params)]
    assert first == [o.token_ids for o in engine.generate(prompts, params)]
    assert all(len(t) == 16 for t in first)


@pytest.mark.parametrize("q_lens,context_lens", [([1, 17, 300, 129], [0, 0, 0, 0]),
                                                 ([1, 17, 300, 129], [0, 40, 0, 300]),
                                                 ([5, 9, 5, 2], [20, 40, 0, 300]),
                                                 ([5, 40, 17, 2], [20, 40, 0, 300])])
@pytest.mark.parametrize("kv_dtype,fp8_dot", [(torch.bfloat16, False), (torch.float8_e4m3fn, False),
                                              (torch.float8_e4m3fn, True)])
def test_bf16_attention_step_matches_the_reference_with_and_without_context(monkeypatch, q_lens, context_lens,
                                                                            kv_dtype, fp8_dot):
    """A step of decodes and prefills through the Triton backend against the torch
    reference on the same pool. On sm_90, fresh prompts take the Hopper kernel's contiguous
    entry point and a step with earlier context (a later chunk, a prefix hit) its paged one
    once a chunk fills a 128-row tile (flash_prefill from an FP8 pool); on any GPU, a step
    of a few new tokens per sequence (speculative verification) takes paged_verify, and the
    rest flash_prefill. fp8_dot: decodes and verification multiply the FP8 pool as e4m3, held
    to tests/kernels/test_paged_decode_fp8_dot.py's bound (prefill widens as before)."""
    from pdserve.engine.attention import AttentionMetadata, triton_backend
    from pdserve.engine.attention.torch_ref import TorchAttention
    from pdserve.engine.kv.pool import KVLayout, KVPool
    from pdserve.engine.models.arch import RopeConfig
    from pdserve.engine.models.rope import RotaryEmbedding

    torch.manual_seed(5)
    heads, kv_heads, head_dim, bs = 32, 8, 128, 16
    layout = KVLayout("test", kv_dtype, 1, kv_heads, head_dim, bs)
    pool = KVPool(layout, 256, "cuda")
    pool.kv.copy_(torch.randn(pool.kv.shape, device="cuda").to(kv_dtype))
    fp8 = kv_dtype == torch.float8_e4m3fn
    decode_lens = [33, 500]
    seq_lens = [c + n for c, n in zip(context_lens, q_lens)]
    perm = torch.randperm(256).tolist()  # scattered blocks, none shared

    def table(n: int) -> list[int]:
        return [perm.pop() for _ in range((n + bs - 1) // bs)]

    decode_tables, prefill_tables = [table(n) for n in decode_lens], [table(n) for n in seq_lens]
    slots = [t[p // bs] * bs + p % bs for t, n in zip(decode_tables, decode_lens) for p in [n - 1]]
    slots += [t[p // bs] * bs + p % bs for t, c, n in zip(prefill_tables, context_lens, seq_lens) for p in range(c, n)]

    def padded(tables: list[list[int]]) -> torch.Tensor:
        width = max(map(len, tables))
        return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device="cuda")

    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device="cuda"), num_decodes=len(decode_lens),
        decode_block_tables=padded(decode_tables),
        decode_seq_lens=torch.tensor(decode_lens, dtype=torch.int32, device="cuda"),
        prefill_cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device="cuda"),
        prefill_seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        prefill_block_tables=padded(prefill_tables), prefill_max_seqlen_q=max(q_lens),
        decode_seq_lens_host=decode_lens, prefill_q_lens_host=q_lens, prefill_seq_lens_host=seq_lens)
    num_tokens = len(slots)
    qkv = torch.randn(num_tokens, heads + 2 * kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    # Each token rotated by its own position (the step applies the rope).
    positions = [n - 1 for n in decode_lens] + [p for c, n in zip(context_lens, seq_lens) for p in range(c, n)]
    rope = RotaryEmbedding(RopeConfig(), head_dim, 1024, torch.device("cuda")).at(
        torch.tensor(positions, device="cuda"))
    q_ref, k_ref, v_ref = q.double(), k.double(), v.double()

    calls = []
    for name in ("flash_prefill_ws", "flash_prefill_ws_paged", "flash_prefill", "paged_verify"):
        kernel = getattr(triton_backend, name)
        monkeypatch.setattr(triton_backend, name,
                            lambda *a, _name=name, _kernel=kernel, **kw: calls.append(_name) or _kernel(*a, **kw))
    # The reference: float64 over a float64 pool, or over an FP8 pool (values rounded as
    # the kernel's cache write rounds them, then widened to float64).
    ref_pool = KVPool(KVLayout("test", kv_dtype if fp8 else torch.float64, 1, kv_heads, head_dim, bs), 256, "cuda")
    ref_pool.kv.copy_(pool.kv)
    attention = triton_backend.TritonAttention(torch.bfloat16, fp8_dot)
    got = attention.begin_step(meta, pool, head_dim ** -0.5)(0, q, k, v, rope)
    want = TorchAttention().begin_step(meta, ref_pool, head_dim ** -0.5)(0, q_ref, k_ref, v_ref, rope)
    # The same K/V written (k rotated in bf16 against float64; FP8 rounds the two a step apart at times).
    tol = 0.13 if fp8 else 2e-2
    torch.testing.assert_close(pool.kv.double(), ref_pool.kv.double(), atol=tol, rtol=tol)
    err = float((got.double() - want).norm() / want.norm())
    assert err < (7e-2 if fp8_dot else 3e-2 if fp8 else 1e-2), err
    hopper = torch.cuda.get_device_capability() == (9, 0)
    if hopper and not any(context_lens):
        want = "flash_prefill_ws"
    elif triton_backend.paged_verify_fits(max(q_lens), heads // kv_heads):
        want = "paged_verify"
    elif hopper and not fp8 and max(q_lens) >= triton_backend.PAGED_PREFILL_MIN_QUERY_LEN:
        want = "flash_prefill_ws_paged"
    else:
        want = "flash_prefill"
    assert calls == [want]


@pytest.mark.parametrize("method, adaptive, kv_cache_dtype, draft_vocab_size", [
    ("self_draft", False, "auto", None), ("draft_model", False, "auto", None), ("ngram", False, "auto", None),
    ("draft_model", True, "auto", None), ("draft_model", False, "fp8", None), ("draft_model", False, "auto", 300),
    ("self_draft", False, "auto", "odd")])
def test_speculation_under_cuda_graphs_keeps_greedy_output(tmp_path, method, adaptive, kv_cache_dtype,
                                                           draft_vocab_size):
    """Verification and draft steps replay their graphs (K + 1 tokens per sequence),
    proposals stay on the device, and greedy output is what plain decoding gives, with
    graphs and without; with adaptive K too (its steps at K = 0 overlap), over FP8
    caches (the target's and the draft's), and with the draft's head trimmed to the first
    300 of 512 token ids or to the odd ones (a ranking file; its graphs capture logits of
    that width)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from pdserve.engine.config import SpecConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         max_position_embeddings=2048, initializer_range=0.2, eos_token_id=None)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(tmp_path))
    gen = torch.Generator().manual_seed(2)
    # Repetitive prompts, so that the n-gram drafter and the early exit get some accepted.
    prompts = [(torch.randint(0, 500, (n,), generator=gen).tolist() * 3)[:3 * n] for n in (7, 40, 130, 300)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    vocab_file = None
    if draft_vocab_size == "odd":
        vocab_file, draft_vocab_size = tmp_path / "ranking.json", None
        vocab_file.write_text(json.dumps(list(range(1, 512, 2))))
    outputs = {}
    for eager in (True, False):
        for spec in (SpecConfig(), SpecConfig(method=method, num_speculative_tokens=3, num_draft_layers=2,
                                              draft_model=str(tmp_path), adaptive=adaptive,
                                              draft_vocab_size=draft_vocab_size,
                                              draft_vocab_file=str(vocab_file) if vocab_file else None)):
            engine = Engine(EngineConfig(
                model=ModelConfig(source=str(tmp_path), device="cuda", dtype="float32", enforce_eager=eager),
                cache=CacheConfig(num_blocks=512, kv_cache_dtype=kv_cache_dtype),
                scheduler=SchedulerConfig(max_num_batched_tokens=256), spec=spec))
            assert engine.pool.kv.dtype == engine.config.cache.kv_dtype(torch.float32)
            outputs[eager, spec.method] = [o.token_ids for o in engine.generate(prompts, params)]
            if spec.enabled:
                assert engine.speculator.metrics.num_passes > 0
                if not eager:  # verification steps replayed graphs (shorter proposals padded)
                    assert sum(n for q, n in engine.runner.graphs.num_replays.items() if q > 1) > 0
                    if method != "ngram" and not adaptive:
                        assert engine.runner.graphs.num_replays.get(4, 0) > 0  # K + 1 = 4
                    drafter = getattr(engine.speculator.drafter, "runner", None)
                    if drafter is not None and not adaptive:
                        # Draft decodes, and the catch-ups behind each verification (K + 1 = 4).
                        assert drafter.graphs.num_replays.get(1, 0) > 0 and drafter.graphs.num_replays.get(4, 0) > 0
                        assert engine.speculator.drafter.num_caught_up > 0
                        if draft_vocab_size is not None or vocab_file is not None:
                            rows = engine.speculator.drafter.runner.model.lm_head.weight.shape[0]
                            assert rows == (draft_vocab_size or 256)
            assert engine.block_manager.num_free_blocks == 512
    want = outputs[True, "none"]
    assert outputs[False, "none"] == want
    assert outputs[True, method] == want
    assert outputs[False, method] == want


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "mixtral", "qwen2_moe"])
def test_the_new_families_on_cuda_match_hf_and_graphs_replay_the_eager_tokens(tmp_path, family):
    """Qwen3 and the MoE families on the GPU (the fused MoE kernel and its Triton router,
    both paths: a decode step's few pairs and a prefill's many) against HF on the same GPU,
    float32, where decode steps replayed from CUDA graphs also give exactly the tokens of
    eager ones."""
    from tests.engine import test_new_families as families

    make_config = getattr(families, family)
    hf = families._saved(make_config, tmp_path).cuda()
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = family_prompts() + [list(range(1, 200))]  # a prompt past 64 pairs: the grouped path
    params = SamplingParams(temperature=0.0, max_tokens=families.NEW_TOKENS, ignore_eos=True)
    engine = Engine(EngineConfig(model=ModelConfig(source=str(tmp_path), device="cuda", dtype="float32"),
                                 cache=CacheConfig(num_blocks=256)))
    for prompt, out in zip(prompts, engine.generate(prompts, params)):
        want, logits = hf_greedy(hf, prompt, families.NEW_TOKENS)
        assert_matches_reference(out.token_ids, want, logits.cpu(), f"{family}, prompt of {len(prompt)}")
    assert engine.runner.graphs is not None
    tokens = {}
    for eager in (True, False):
        engine = Engine(EngineConfig(
            model=ModelConfig(source=str(tmp_path), device="cuda", dtype="float32", enforce_eager=eager),
            cache=CacheConfig(num_blocks=256)))
        tokens[eager] = [o.token_ids for o in engine.generate(prompts, params)]
        if not eager:
            assert sum(engine.runner.graphs.num_replays.values()) > 0
    assert tokens[True] == tokens[False]
