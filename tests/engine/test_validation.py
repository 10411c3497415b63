"""Bad input gets a clear ValueError naming the problem, and the engine keeps serving."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.attention import backend_for
from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sampling import SamplingParams


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.1}, "temperature must be >= 0"),
    ({"top_p": 0.0}, "top_p must be in (0, 1]"),
    ({"top_p": 1.5}, "top_p must be in (0, 1]"),
    ({"top_k": -2}, "top_k must be -1"),
    ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ({"min_p": 2.0}, "min_p must be in [0, 1]"),
    ({"stop": ("",)}, "stop strings must not be empty"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("source, message", [
    ("/nonexistent/model", "does not exist"),
    ("dummy:no-such-shape", "unknown dummy shape"),
])
def test_bad_model_source(source, message):
    with pytest.raises(ValueError, match=message):
        Engine(EngineConfig(model=ModelConfig(source=source, device="cpu")))


def test_folder_that_is_not_a_model(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="not a supported model folder"):
        Engine(EngineConfig(model=ModelConfig(source=str(tmp_path), device="cpu")))


def test_file_that_is_not_gguf(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="not a .gguf file"):
        Engine(EngineConfig(model=ModelConfig(source=str(f), device="cpu")))


@pytest.mark.parametrize("bad", [{"dtype": "int8"}, {"device": "tpu"}, {"max_model_len": 1}])
def test_bad_model_config(bad):
    with pytest.raises(ValueError, match="ModelConfig"):
        ModelConfig(**bad)


def test_bad_cache_config():
    with pytest.raises(ValueError, match="block_size"):
        CacheConfig(block_size=12)
    with pytest.raises(ValueError, match="kv_cache_dtype must be 'auto' or 'fp8', got 'fp4'"):
        CacheConfig(kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="fp8_attention_dot .* needs kv_cache_dtype 'fp8', got 'auto'"):
        CacheConfig(fp8_attention_dot=True)
    assert CacheConfig(kv_cache_dtype="fp8", fp8_attention_dot=True).fp8_attention_dot


def test_fp8_attention_dot_is_refused_off_cuda():
    """Only the Triton kernels have the FP8 dot: a CPU engine says so instead of ignoring it."""
    with pytest.raises(ValueError, match="fp8_attention_dot is a mode of the CUDA"):
        backend_for(torch.device("cpu"), torch.float32, fp8_dot=True)


@pytest.mark.slow
def test_bad_requests_are_refused_while_others_keep_running(engine):
    good = engine.add_request("The capital of France is", SamplingParams(temperature=0.0, max_tokens=6))
    engine.step()
    too_long = [1] * engine.max_model_len
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("", SamplingParams())
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError, match=f"prompt has {engine.max_model_len} tokens"):
        engine.add_request(too_long, SamplingParams())
    with pytest.raises(ValueError, match="unknown stop token ids"):
        engine.add_request("hi", SamplingParams(stop_token_ids=(10**9,)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([5, -1], SamplingParams())
    with pytest.raises(ValueError, match="stop strings are checked on text"):
        engine.add_request("hi", SamplingParams(stop=("x",)))  # the engine makes no text: generate() does
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("hi", SamplingParams(), request_id=good)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.generate(["fine", ""], SamplingParams())  # nothing of the batch is queued
    finished = []
    while engine.has_unfinished:
        finished += [d for d in engine.step() if d.finished]
    assert [d.request_id for d in finished] == [good]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
