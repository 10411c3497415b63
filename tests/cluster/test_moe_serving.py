"""A Mixture-of-Experts model served disaggregated: a tiny Qwen3-MoE (transformers' own
class, random weights, saved as a folder) over real Ray actors, real UCX and real gRPC
gives the offline engine's greedy tokens, and every KV block is free afterwards."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sampling import SamplingParams
from pdserve.proto.v1 import generation_pb2 as pb
from tests.cluster.streams import collect_concurrently, pools_are_full, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    folder = tmp_path_factory.mktemp("qwen3-moe")
    config = Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                            initializer_range=0.3, eos_token_id=None, num_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=32, norm_topk_prob=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(folder))
    return folder


def test_a_tiny_qwen3_moe_served_disaggregated_gives_the_engines_tokens(start, moe_folder):
    model = {"source": str(moe_folder), "device": "cpu", "dtype": "float32"}
    srv = start(engine={"model": model, "cache": {"cpu_kv_cache_gib": 0.25}}, pools={"mode": "disaggregated"})
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (4, 37, 120)]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * len(prompts)
    want = [o.token_ids for o in Engine(EngineConfig(model=ModelConfig(**model))).generate(prompts, params)]
    got = collect_concurrently(srv.target, prompts, params)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.token_ids == w, f"request {i} ({len(prompts[i])} prompt tokens) differs"
        assert g.finish_reason == pb.FINISH_REASON_LENGTH
    wait_until(lambda: pools_are_full(srv.target), 10, "every block to be free")
