"""pdserve on two GPUs under real Ray: the prefill worker on one GPU, the decode worker on
the other, each request's KV written straight into the decode pool (direct writes over
the CUDA IPC mapping the UCX handshake set up), streamed to real gRPC clients.

A tiny random Llama (head dim 128, GQA) built on the spot, float32, against Hugging Face
greedy decoding with the near-tie rule; prompts long enough for chunked prefill and a
prefix hit on the prefill worker. Run on a two-GPU machine with Ray installed:
`pytest -m gpu tests/cluster/test_serving_gpu.py`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.engine.sampling import SamplingParams
from tests.cluster.streams import collect_concurrently, pools_are_full, wait_until
from tests.engine.hf_reference import assert_matches_reference, hf_greedy

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=1024, intermediate_size=1024, num_hidden_layers=3,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=128, max_position_embeddings=4096,
                         initializer_range=0.2, eos_token_id=None)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    folder = tmp_path_factory.mktemp("tiny-llama")
    hf.save_pretrained(str(folder))
    return folder, hf


def _kv_bytes_by_path(registry: Any) -> dict[tuple[str, str], float]:
    return {(s.labels["transport"], s.labels["path"]): s.value
            for metric in registry.collect() if metric.name == "pdserve_kv_transfer_bytes"
            for s in metric.samples if s.name.endswith("_total")}


def test_two_gpus_serve_hf_tokens_over_direct_writes(start, tiny_llama):
    folder, hf = tiny_llama
    srv = start(engine={"model": {"source": str(folder), "device": "cuda", "dtype": "float32"},
                        "cache": {"num_blocks": 512}, "scheduler": {"max_num_batched_tokens": 512}},
                pools={"mode": "disaggregated", "num_prefill": 1, "num_decode": 1, "gpus_per_worker": 1})
    assert srv.server.coordinator.mode == "disaggregated"
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, 1000, (100,), generator=gen).tolist()
    prompts = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (1, 17, 300, 900)]
    prompts.append(prefix + [5, 6, 7])
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    got = collect_concurrently(srv.target, prompts, [params] * len(prompts))
    # Its first 96 tokens from the prefill worker's prefix cache: a paged prefill after context.
    got += collect_concurrently(srv.target, [prefix + [8]], [params])
    prompts.append(prefix + [8])
    for prompt, out in zip(prompts, got):
        want, logits = hf_greedy(hf, prompt, NEW_TOKENS)
        assert_matches_reference(out.token_ids, want, logits, f"prompt of {len(prompt)} tokens")
    wait_until(lambda: pools_are_full(srv.target), 10, "every block to be free")
    moved = _kv_bytes_by_path(srv.server.metrics.registry)
    # Every transfer went the direct way over NVLink (cuda_ipc), none fell back to messages.
    assert set(moved) == {("cuda_ipc", "direct")}, moved
    assert moved[("cuda_ipc", "direct")] > 0
