"""The engine on CUDA (Triton kernels, CUDA-graph decode) against transformers on the same GPU.

Tiny random models are built on the spot (no download), with the head dims the
kernels serve (64 and 128), GQA, and prompts long enough for chunked prefill
and prefix hits. Run on a GPU machine: `pytest -m gpu tests/engine/test_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine import Engine
from engine.sampling import SamplingParams
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


def test_bf16_dummy_llama_runs_and_is_deterministic():
    config = EngineConfig(model=ModelConfig(source="dummy:llama-3.2-1b", device="cuda", max_model_len=4096),
                          cache=CacheConfig(num_blocks=2048, enable_prefix_caching=False))
    engine = Engine(config)
    prompts = [[1 + i] * (50 + 40 * i) for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    first = [o.token_ids for o in engine.generate(prompts, params)]
    assert first == [o.token_ids for o in engine.generate(prompts, params)]
    assert all(len(t) == 16 for t in first)
