"""Test-session setup shared by every test package, and fixtures around the real
default model (SmolLM2-135M-Instruct, fp32, CPU)."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

# Triton kernels need a GPU driver; without one they run in Triton's interpreter.
# This must be set before any module decorates a @triton.jit function.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# An xdist worker computes on its share of the cores: two workers of two torch threads each on
# CI's two cores spin against each other (measured: two engines generating at once took 56 s
# each at 2 threads, 14-17 s at 1; alone, 11 s at 2 threads, 12 at 1).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))

# The randomized tests' seed (the fuzzer's): a new one each run, so that their coverage
# accumulates over runs, the same in every xdist worker (they inherit the environment set
# here), printed in the header so that a failure reproduces with PDSERVE_TEST_SEED=<seed>.
SEED_VARIABLE = "PDSERVE_TEST_SEED"
os.environ.setdefault(SEED_VARIABLE, str(secrets.randbelow(2**32)))


def pytest_report_header(config) -> str:
    return f"randomized tests' seed: {os.environ[SEED_VARIABLE]} (set {SEED_VARIABLE} to repeat it)"


# The longest modules first (their worker-seconds on CI's 2-core machine beside another
# worker, from the profile of 2026-12-05 07:02 UTC, after the cluster tests moved to the
# small model): xdist's workers take modules in collection order (`make test` passes
# --no-loadscope-reorder, without which xdist hands out the modules with the most tests
# first), so the longest start at once instead of ending the run on one worker while the
# other idles (longest-processing-time-first).
SLOWEST_MODULES = (
    "tests/engine/speculative/test_spec_engine.py",  # ~620
    "tests/kv_transport/test_ucx_processes.py",  # ~590
    "tests/engine/test_hf_parity.py",  # ~550 (when its HF references are not cached yet)
    "tests/cluster/test_failover.py",  # ~300
    "tests/cluster/test_tensor_parallel_serving.py",  # ~250
    "tests/cluster/test_liveness.py",  # ~190
    "tests/deploy/test_ray_up.py",  # ~190
    "tests/cluster/test_from_checkout.py",  # ~150
    "tests/cluster/test_api_tools.py",  # ~150
    "tests/kernels/test_flash_prefill.py",  # ~150
    "tests/cluster/test_serving.py",  # ~130
    "tests/cluster/test_elastic.py",  # ~80 alone (its own server of three workers, two more added)
    "tests/engine/test_new_families.py",
    "tests/engine/runner/test_tensor_parallel.py",
    "tests/engine/test_engine.py",
    "tests/cluster/test_structured_outputs.py",
    "tests/cluster/test_http_api.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    rank = {path: i for i, path in enumerate(SLOWEST_MODULES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order


from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from pdserve.engine.engine import Engine  # noqa: E402
from pdserve.engine.models.weights import resolve_model  # noqa: E402


@pytest.fixture(scope="session")
def model_folder() -> Path:
    folder = resolve_model(ModelConfig()).folder
    assert folder is not None
    return folder


@pytest.fixture(scope="session")
def hf_model(model_folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_folder), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_references(request, hf_model):
    """HF greedy references of the default model, shared across runs and environments
    (`make test` and `make test-newest` of one checkout) on disk under pytest's cache dir:
    HF's generate on the CPU takes minutes for the parity tests' prompts."""
    from tests.engine.hf_reference import CachedReferences

    return CachedReferences(Path(request.config.cache.mkdir("hf-references")), hf_model)


@pytest.fixture(scope="session")
def tokenizer(model_folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_folder))


MakeEngine = Callable[..., Engine]


@pytest.fixture(scope="session")
def make_engine() -> MakeEngine:
    """Engine on the default model, CPU fp32; keyword args override cache/scheduler fields."""

    def make(num_blocks: int | None = None, max_num_batched_tokens: int = 2048, max_num_seqs: int = 128,
             enable_prefix_caching: bool = True, seed: int = 0, async_scheduling: bool = True,
             kv_cache_dtype: str = "auto", policy: str = "fcfs") -> Engine:
        return Engine(EngineConfig(
            model=ModelConfig(device="cpu", dtype="float32", seed=seed),
            cache=CacheConfig(num_blocks=num_blocks, cpu_kv_cache_gib=0.25,
                              enable_prefix_caching=enable_prefix_caching, kv_cache_dtype=kv_cache_dtype),
            scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                      async_scheduling=async_scheduling, policy=policy),
        ))

    return make


@pytest.fixture(scope="session")
def default_engine(make_engine: MakeEngine) -> Engine:
    return make_engine()


@pytest.fixture(scope="session")
def engine(default_engine: Engine) -> Engine:
    """The default model's engine (tests/cluster overrides it with the small model's)."""
    return default_engine


@dataclass(frozen=True)
class SmallModel:
    """A 2-layer random Llama with the default model's head layout (9 query heads, 3 KV
    heads, tied embeddings), vocabulary and tokenizer, saved as a checkpoint folder: for the
    tests whose point is the machinery around a model (serving, migration, the APIs, tensor
    parallelism over 3 ranks), where the default model's 30 layers are minutes of CI's CPU.
    The default model itself is served end to end by the `pdserve serve` tests (test_private,
    test_from_checkout, the `ray up` test) and held to Hugging Face by test_hf_parity."""

    folder: Path
    hf: Any  # its transformers model, for references

    def engine_config(self) -> ModelConfig:
        return ModelConfig(source=str(self.folder), device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def small_model(tmp_path_factory, tokenizer) -> SmallModel:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=9 * 16, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         tie_word_embeddings=True, initializer_range=0.3, eos_token_id=tokenizer.eos_token_id)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    folder = tmp_path_factory.mktemp("small-model")
    hf.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return SmallModel(folder, hf)
