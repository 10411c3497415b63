"""The MoE families at their real expert widths in float32 on the GPU, two layers each, against
HF on the same GPU (issue 53: a Qwen3-MoE folder at Qwen3-30B-A3B's expert shape raised
Triton's OutOfResources from the fused MoE kernel on the first prompt, its float32 tiles
asking 417,792 bytes of an H100's 232,448; bf16 ran).

Prompts of 1 to ~700 tokens put one step's tokens on every row of the swept table (per-pair
plans in the decode steps, grouped ones of 256, 512 and 2,048 tokens in prefill), decode
steps replayed from CUDA graphs. Each family: ~5-12 GB of float32 weights, held twice (HF's
copy and the engine's). Run: `pytest -m gpu -p no:cacheprovider tests/engine/test_gpu_moe_widths.py`.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sampling import SamplingParams
from tests.engine.hf_reference import assert_matches_reference, hf_greedy

pytestmark = pytest.mark.gpu
NEW_TOKENS = 8
# Two layers, a small vocabulary; initializer_range keeps the logits' and the router's gaps
# far above float32's rounding at these widths (no near-ties by chance).
COMMON = dict(vocab_size=1024, num_hidden_layers=2, max_position_embeddings=4096, initializer_range=0.05,
              eos_token_id=None)


def qwen3_30b_a3b():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**COMMON, hidden_size=2048, intermediate_size=6144, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768, norm_topk_prob=True)


def mixtral_8x7b():
    from transformers import MixtralConfig

    return MixtralConfig(**COMMON, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                         num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2)


def qwen1_5_moe_a2_7b():
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(**COMMON, hidden_size=2048, intermediate_size=5632, num_attention_heads=16,
                          num_key_value_heads=16, num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
                          shared_expert_intermediate_size=5632, norm_topk_prob=False)


@pytest.mark.parametrize("make_config", [qwen3_30b_a3b, mixtral_8x7b, qwen1_5_moe_a2_7b])
def test_real_expert_widths_in_float32_match_hf(tmp_path, make_config):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):  # random init on the GPU: seconds, not minutes, at these sizes
        hf = AutoModelForCausalLM.from_config(make_config(), dtype=torch.float32).eval()
    hf.save_pretrained(str(tmp_path))
    torch.backends.cuda.matmul.allow_tf32 = False
    engine = Engine(EngineConfig(model=ModelConfig(source=str(tmp_path), device="cuda", dtype="float32",
                                                   max_model_len=1024),
                                 cache=CacheConfig(num_blocks=512),
                                 scheduler=SchedulerConfig(max_num_seqs=8)))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (1, 5, 200, 300, 700)]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for prompt in prompts[2:]:  # alone: a prefill step of 200, 300 and 700 tokens (the 256/512/2,048 plans)
        [out] = engine.generate([prompt], params)
        want, logits = hf_greedy(hf, prompt, NEW_TOKENS)
        assert_matches_reference(out.token_ids, want, logits.cpu(), f"{make_config.__name__}, prompt {len(prompt)}")
    for prompt, out in zip(prompts, engine.generate(prompts, params)):  # together: decode batches of 1-5
        want, logits = hf_greedy(hf, prompt, NEW_TOKENS)
        assert_matches_reference(out.token_ids, want, logits.cpu(), f"{make_config.__name__}, prompt {len(prompt)}")
    assert sum(engine.runner.graphs.num_replays.values()) > 0
