"""Our forward against transformers on tiny random models of each supported family.

Covers what the default model does not exercise: Llama-3 RoPE scaling, linear
scaling, untied embeddings, Qwen2's QKV bias, Mistral's config, and loading a
plain Hugging Face folder (config.json + safetensors, no tokenizer).
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sampling import SamplingParams
from tests.engine.hf_reference import assert_matches_reference, hf_greedy

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3, eos_token_id=None)


def llama3_scaled():
    from transformers import LlamaConfig

    return LlamaConfig(**TINY, tie_word_embeddings=False, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})


def llama_linear():
    from transformers import LlamaConfig

    return LlamaConfig(**TINY, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})


def qwen2():
    from transformers import Qwen2Config

    return Qwen2Config(**TINY, tie_word_embeddings=True)


def mistral():
    from transformers import MistralConfig

    return MistralConfig(**TINY, sliding_window=None)


@pytest.mark.parametrize("make_config", [llama3_scaled, llama_linear, qwen2, mistral])
def test_greedy_matches_hf(make_config, tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(make_config(), dtype=torch.float32).eval()
    hf.save_pretrained(str(tmp_path))
    engine = Engine(EngineConfig(model=ModelConfig(source=str(tmp_path), device="cpu", dtype="float32")))
    assert engine.tokenizer is None
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 250, (n,), generator=gen).tolist() for n in (3, 40, 200)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = engine.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        want, logits = hf_greedy(hf, prompt, 24)
        assert_matches_reference(out.token_ids, want, logits, f"{make_config.__name__}, prompt of {len(prompt)}")


def test_sliding_window_is_refused(tmp_path):
    from transformers import AutoModelForCausalLM, MistralConfig

    AutoModelForCausalLM.from_config(MistralConfig(**TINY, sliding_window=128)).save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="sliding-window"):
        Engine(EngineConfig(model=ModelConfig(source=str(tmp_path), device="cpu")))


def test_dummy_weights_are_seeded_and_need_token_ids():
    def run(seed: int) -> list[int]:
        engine = Engine(EngineConfig(model=ModelConfig(source="dummy:tiny", device="cpu", seed=seed)))
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        return engine.generate([[1, 2, 3, 4]], params)[0].token_ids

    assert run(0) == run(0)
    assert run(0) != run(1)
    engine = Engine(EngineConfig(model=ModelConfig(source="dummy:tiny", device="cpu")))
    with pytest.raises(ValueError, match="no tokenizer"):
        engine.add_request("text", SamplingParams())


@pytest.mark.slow
def test_gguf_file_source_uses_the_conversion_cache(model_folder):
    from pdserve.engine.models.weights import default_gguf_path, resolve_model

    files = resolve_model(ModelConfig(source=str(default_gguf_path())))
    assert files.folder == model_folder and files.arch.num_layers == 30
