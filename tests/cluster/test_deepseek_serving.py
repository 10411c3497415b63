"""DeepSeek-V3 served disaggregated (issue 52, "through real workers"): a tiny random V3
(transformers' own `DeepseekV3Config`, MLA with `q_lora_rank`, YaRN, a dense first layer, a
shared expert, a non-zero `e_score_correction_bias`; tests/engine/test_deepseek.py's model)
over real Ray actors, real UCX and real gRPC gives colocated serving's greedy tokens, and a
request's KV crosses the wire as the latent layout's bytes: one latent per token (kv_lora_rank
+ qk_rope_head_dim wide), no K and V pair."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.cluster.clients.grpc_client import Client
from pdserve.engine.kv.pool import KVLayout
from pdserve.engine.sampling import SamplingParams
from pdserve.proto.v1 import generation_pb2 as pb
from tests.cluster.streams import pools_are_full, wait_until
from tests.engine.test_deepseek import _hf_model, v3

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16  # CacheConfig's default, which both servers run
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek-v3")
    _hf_model(v3()).save_pretrained(str(path))
    return path


def _sections(folder, mode: str) -> dict:
    return {"engine": {"model": {"source": str(folder), "device": "cpu", "dtype": "float32"},
                       "cache": {"cpu_kv_cache_gib": 0.25}},
            "pools": {"mode": mode}}


@pytest.fixture(scope="module")
def disaggregated(start, folder):
    return start(**_sections(folder, "disaggregated"))


@pytest.fixture(scope="module")
def colocated(start, folder):
    return start(**_sections(folder, "colocated"))


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 250, (n,), generator=gen).tolist() for n in lengths]


def _serve(target: str, prompt: list[int]) -> tuple[list[int], list]:
    """(greedy token ids, the last response's kv_transfers) of one request."""
    with Client(target) as client:
        responses = list(client.generate(prompt, GREEDY, timeout_s=300))
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    return [t for r in responses for t in r.token_ids], list(responses[-1].kv_transfers)


def test_disaggregated_deepseek_v3_gives_colocated_tokens(disaggregated, colocated):
    # Within one block, across two, and past four (a partial last block each time but the second).
    prompts = _prompts(3, (5, 32, 70))
    for i, prompt in enumerate(prompts):
        got, _ = _serve(disaggregated.target, prompt)
        want, none = _serve(colocated.target, prompt)
        assert not none  # colocated serving moves no KV
        assert len(got) == GREEDY.max_tokens and got == want, f"request {i} ({len(prompt)} prompt tokens) differs"
    wait_until(lambda: pools_are_full(disaggregated.target), 30, "every block to be free")


def test_a_requests_kv_crosses_the_wire_as_one_latent_per_token(disaggregated, folder):
    config = v3()
    latent_dim = config.kv_lora_rank + config.qk_rope_head_dim
    latent = KVLayout(model=str(folder), dtype=torch.float32, num_layers=config.num_hidden_layers, num_kv_heads=1,
                      head_dim=latent_dim, block_size=BLOCK_SIZE, kind="mla")
    # The arithmetic spelled out (float32: 4 bytes): no factor 2 for K and V, no per-head width.
    assert latent.bytes_per_block == config.num_hidden_layers * BLOCK_SIZE * latent_dim * 4
    for prompt in _prompts(4, (9, 16, 50)):  # prompts of their own: no block the decode worker has cached
        _, transfers = _serve(disaggregated.target, prompt)
        [transfer] = transfers
        assert transfer.transport in ("shm", "tcp") and not transfer.direct  # UCX between two CPU workers
        num_blocks = math.ceil(len(prompt) / BLOCK_SIZE)
        assert transfer.bytes == num_blocks * latent.bytes_per_block, (len(prompt), transfer.bytes)
    wait_until(lambda: pools_are_full(disaggregated.target), 30, "every block to be free")
