"""Tensor-parallel workers behind real Ray, real UCX and real gRPC, on the CPU (gloo).

- Colocated: the small model (a 2-layer random Llama with the default model's head layout, 9
  heads and 3 KV heads, its tokenizer and vocabulary) over three ranks streams Hugging Face's
  greedy tokens of that model. (The point is the three-way split, not the model: the default
  model's 30 layers on three gloo ranks took minutes of CI's CPU.)
- Disaggregated between pools of different tensor-parallel sizes (2 -> 1, 1 -> 2, 2 -> 4;
  at 4 ranks the tiny model's 2 KV heads are replicated; 1 -> 2 with a tiny Qwen3-MoE, its
  experts sliced over the decode pool's ranks): the KV crosses over UCX in the
  model's layout, and the streams equal one in-process engine of one rank; every block of
  both pools is free afterwards.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sampling import SamplingParams
from tests.cluster.streams import collect_concurrently, pools_are_full, wait_until
from tests.engine.hf_reference import assert_matches_reference, hf_greedy
from tests.engine.prompts import prompt_ids

pytestmark = pytest.mark.slow

NEW_TOKENS = 16
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3, eos_token_id=None)


def test_a_colocated_tensor_parallel_worker_streams_hf_greedy_tokens(start, tokenizer, small_model):
    srv = start(pools={"mode": "colocated", "decode_tp": 3})  # the small model: the default's head layout
    prompts = [prompt_ids(tokenizer, n, variant=i) for i, n in enumerate([5, 48, 130])]
    params = [SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)] * len(prompts)
    got = collect_concurrently(srv.target, prompts, params)
    for prompt, out in zip(prompts, got):
        want, logits = hf_greedy(small_model.hf, prompt, NEW_TOKENS)
        assert_matches_reference(out.token_ids, want, logits, f"TP 3 worker, prompt of {len(prompt)}")
    wait_until(lambda: pools_are_full(srv.target), 10, "every block to be free")


def _tiny_config(family: str):
    from transformers import LlamaConfig, Qwen3MoeConfig

    if family == "qwen3_moe":  # 8 experts, top 2: sliced over a pool's ranks like the dense MLP
        return Qwen3MoeConfig(**TINY, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                              norm_topk_prob=True)
    return LlamaConfig(**TINY)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> (folder, prompts, params, one in-process engine's tokens) of a tiny random
    model of that family, made on first use."""
    from transformers import AutoModelForCausalLM

    made: dict[str, tuple[str, list[list[int]], list[SamplingParams], list[list[int]]]] = {}

    def make(family: str):
        if family not in made:
            torch.manual_seed(0)
            folder = str(tmp_path_factory.mktemp(f"tiny-{family}"))
            AutoModelForCausalLM.from_config(_tiny_config(family), dtype=torch.float32).save_pretrained(folder)
            gen = torch.Generator().manual_seed(3)
            prompts = [torch.randint(0, 250, (n,), generator=gen).tolist() for n in (4, 37, 90, 150)]
            params = [SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)] * len(prompts)
            engine = Engine(EngineConfig(model=ModelConfig(source=folder, device="cpu", dtype="float32")))
            made[family] = folder, prompts, params, [o.token_ids for o in engine.generate(prompts, params)]
        return made[family]

    return make


@pytest.mark.parametrize("prefill_tp, decode_tp, family", [(2, 1, "llama"), (1, 2, "qwen3_moe"), (2, 4, "llama")])
def test_disaggregated_pools_of_different_tensor_parallel_sizes(start, tiny, prefill_tp, decode_tp, family):
    folder, prompts, params, want = tiny(family)
    srv = start(engine={"model": {"source": folder, "device": "cpu", "dtype": "float32"},
                        "cache": {"cpu_kv_cache_gib": 0.05}},
                pools={"mode": "disaggregated", "prefill_tp": prefill_tp, "decode_tp": decode_tp})
    got = collect_concurrently(srv.target, prompts, params)
    for prompt, out, w in zip(prompts, got, want):
        assert out.token_ids == w, f"{family}: prefill TP {prefill_tp} -> decode TP {decode_tp}, prompt {len(prompt)}"
    wait_until(lambda: pools_are_full(srv.target), 10, "every block of both pools to be free")
