"""MTP drafting through real workers (issue 52: "its acceptance is the same disaggregated as
colocated"): a tiny random DeepSeek-V3 with an MTP layer the test writes
(tests/engine/speculative/test_mtp.py's one-layer model, a good drafter on purpose), served
with `--spec-method mtp` over real Ray actors, real UCX and real gRPC. The prefill worker
computes the prompt's MTP KV (one more layer of the latent pool) and sends it with the
target's, the hidden state at the last prompt token rides with the first token, and the
decode worker then drafts as a colocated one does: the same tokens, as many drafts accepted
per request, and a request's KV on the wire as one latent per token for each layer, the MTP
layer's included."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.cluster.clients.grpc_client import Client
from pdserve.engine.kv.pool import KVLayout
from pdserve.engine.sampling import SamplingParams
from pdserve.proto.v1 import generation_pb2 as pb
from tests.cluster.streams import free_port, pools_are_full, scrape, wait_until
from tests.engine.speculative.test_mtp import write_mtp_checkpoint
from tests.engine.test_deepseek import v3

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16  # CacheConfig's default, which both servers run
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_mtp_checkpoint(tmp_path_factory.mktemp("deepseek-v3-mtp"))


def _sections(folder, mode: str) -> dict:
    return {"engine": {"model": {"source": str(folder), "device": "cpu", "dtype": "float32"},
                       "cache": {"cpu_kv_cache_gib": 0.25},
                       "spec": {"method": "mtp", "num_speculative_tokens": 3}},
            "pools": {"mode": mode}, "server": {"metrics_port": free_port()}}


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


def _accepted(server) -> float:
    """Draft tokens its workers' targets accepted so far, once every request has ended (the
    load that shows the pools free is the one the metrics have, and it counts every step)."""
    wait_until(lambda: pools_are_full(server.target), 30, "every block to be free")
    return sum(v for k, v in scrape(server.config.server.metrics_port).items()
               if k.startswith("pdserve_spec_accepted_tokens{"))


def test_a_request_accepts_as_many_mtp_drafts_disaggregated_as_colocated(disaggregated, colocated):
    # Within one block, across two, and past four.
    accepted: dict[str, list[float]] = {"disaggregated": [], "colocated": []}
    for i, prompt in enumerate(_prompts(3, (5, 32, 70))):
        before = _accepted(disaggregated), _accepted(colocated)
        got, _ = _serve(disaggregated.target, prompt)
        want, _ = _serve(colocated.target, prompt)
        assert len(got) == GREEDY.max_tokens and got == want, f"request {i} ({len(prompt)} prompt tokens) differs"
        accepted["disaggregated"].append(_accepted(disaggregated) - before[0])
        accepted["colocated"].append(_accepted(colocated) - before[1])
    assert accepted["disaggregated"] == accepted["colocated"] and min(accepted["colocated"]) > 0, accepted


def test_the_mtp_layers_latents_cross_the_wire_with_the_targets(disaggregated, folder):
    config = v3()
    latent_dim = config.kv_lora_rank + config.qk_rope_head_dim
    num_layers = 2  # the model's one decoder layer and its MTP layer
    latent = KVLayout(model=str(folder), dtype=torch.float32, num_layers=num_layers, num_kv_heads=1,
                      head_dim=latent_dim, block_size=BLOCK_SIZE, kind="mla")
    assert latent.bytes_per_block == num_layers * BLOCK_SIZE * latent_dim * 4
    for prompt in _prompts(4, (9, 50)):  # prompts of their own: no block the decode worker has cached
        _, [transfer] = _serve(disaggregated.target, prompt)
        assert transfer.bytes == math.ceil(len(prompt) / BLOCK_SIZE) * latent.bytes_per_block, (len(prompt),
                                                                                              transfer.bytes)
    wait_until(lambda: pools_are_full(disaggregated.target), 30, "every block to be free")
