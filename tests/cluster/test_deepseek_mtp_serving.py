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
import time

import pytest
import torch

from pdserve.engine.kv.pool import KVLayout
from tests.cluster.streams import free_port, pools_are_full, scrape, wait_until
from tests.cluster.test_deepseek_serving import BLOCK_SIZE, GREEDY, _prompts, _serve
from tests.engine.speculative.test_mtp import write_mtp_checkpoint
from tests.engine.test_deepseek import v3

pytestmark = pytest.mark.slow



@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_mtp_checkpoint(tmp_path_factory.mktemp("deepseek-v3-mtp"))


def _sections(folder, mode: str) -> dict:
    return {"engine": {"model": {"source": str(folder), "device": "cpu", "dtype": "float32"},
                       "cache": {"cpu_kv_cache_gib": 0.25},
                       "spec": {"method": "mtp", "num_speculative_tokens": 3}},
            "pools": {"mode": mode}, "server": {"metrics_port": free_port()}}


@pytest.fixture(scope="module")
def servers(start, folder) -> dict:
    """Both modes' servers of the MTP model, by mode."""
    return {mode: start(**_sections(folder, mode)) for mode in ("disaggregated", "colocated")}


def _accepted(server) -> float:
    """Draft tokens its workers' targets accepted so far, once every request has ended and the
    count has settled: the metrics follow the workers' loads, read every `load_refresh_s`, and
    one read just after a request may still be a load from before its last step; so the
    same count, with every block free, twice, several load reads apart (bounded)."""
    interval = 4 * server.config.coordinator.load_refresh_s
    last = None
    for _ in range(30):
        wait_until(lambda: pools_are_full(server.target), 30, "every block to be free")
        count = sum(v for k, v in scrape(server.config.server.metrics_port).items()
                    if k.startswith("pdserve_spec_accepted_tokens{"))
        if count == last:
            return count
        last = count
        time.sleep(interval)
    raise AssertionError(f"the accepted count did not settle: {last}")


def test_a_request_accepts_as_many_mtp_drafts_disaggregated_as_colocated(servers):
    # Within one block, across two, and past four.
    accepted: dict[str, list[float]] = {mode: [] for mode in servers}
    for i, prompt in enumerate(_prompts(3, (5, 32, 70))):
        tokens = {}
        for mode, server in servers.items():
            before = _accepted(server)
            tokens[mode], _ = _serve(server.target, prompt)
            accepted[mode].append(_accepted(server) - before)
        got, want = tokens["disaggregated"], tokens["colocated"]
        assert len(got) == GREEDY.max_tokens and got == want, f"request {i} ({len(prompt)} prompt tokens) differs"
    assert accepted["disaggregated"] == accepted["colocated"] and min(accepted["colocated"]) > 0, accepted


def test_the_mtp_layers_latents_cross_the_wire_with_the_targets(servers, folder):
    disaggregated = servers["disaggregated"]
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
