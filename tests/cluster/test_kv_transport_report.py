"""The KV transport a request took, and `kv_transport.require`, through real servers (real Ray
actors, UCX between them, the grpc and httpx clients) on the CPU.

Each disaggregated request's last gRPC response says how its KV moved (transport, bytes,
seconds), and the same transfer is counted in the Prometheus metrics by transport. A server
whose pairs must use CUDA IPC (two CPU workers reach each other over shm or tcp) fails its
requests with FAILED_PRECONDITION naming the transport it found and the setting, and leaves
every block free.
"""

from __future__ import annotations

import grpc
import httpx
import pytest

from pdserve.cluster.clients.grpc_client import Client
from pdserve.engine.sampling import SamplingParams
from tests.cluster.streams import pools_are_full, wait_until

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _responses(target: str, params: SamplingParams, prompt: str = "The capital of France is") -> list:
    with Client(target) as client:
        return list(client.generate(prompt, params, timeout_s=300))


def _samples(srv, name: str) -> dict[str, float]:
    """{transport: value} of one metric sample (e.g. pdserve_kv_transfer_bytes_total)."""
    return {s.labels["transport"]: s.value for metric in srv.server.metrics.registry.collect()
            for s in metric.samples if s.name == name}


@pytest.fixture(scope="module")
def srv(start):
    return start(pools={"mode": "disaggregated", "actor_max_concurrency": 64}, loop={"idle_wait_s": 0.02})


@pytest.fixture(scope="module")
def strict(start):
    return start(pools={"mode": "disaggregated"}, kv_transport={"require": "cuda_ipc"})


def test_the_last_response_says_how_the_kv_moved_and_the_metrics_count_it(srv):
    bytes_before = _samples(srv, "pdserve_kv_transfer_bytes_total")
    count_before = _samples(srv, "pdserve_kv_transfer_seconds_count")
    responses = _responses(srv.target, GREEDY)
    *streamed, last = responses
    assert last.finish_reason and not any(r.kv_transfers for r in streamed)
    [transfer] = last.kv_transfers
    assert transfer.transport in ("shm", "tcp") and not transfer.direct  # two CPU workers of one host
    assert transfer.bytes > 0 and transfer.seconds > 0
    bytes_after = _samples(srv, "pdserve_kv_transfer_bytes_total")
    count_after = _samples(srv, "pdserve_kv_transfer_seconds_count")
    assert bytes_after[transfer.transport] - bytes_before.get(transfer.transport, 0) == transfer.bytes
    assert count_after[transfer.transport] - count_before.get(transfer.transport, 0) == 1


def test_a_request_that_ends_at_its_first_token_moved_no_kv(srv):
    [only] = _responses(srv.target, SamplingParams(temperature=0.0, max_tokens=1))
    assert only.finish_reason and len(only.kv_transfers) == 0


def test_the_loop_section_reaches_the_workers(srv):
    import ray

    for pool in srv.server.worker_set.pools():
        for w in pool.workers:
            assert ray.get(w.actor.__ray_call__.remote(lambda self: self.loop.config.idle_wait_s), timeout=60) == 0.02


def test_a_pair_slower_than_required_fails_with_failed_precondition(strict):
    with pytest.raises(grpc.RpcError) as failed:
        _responses(strict.target, GREEDY)
    error = failed.value
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error
    details = error.details()
    assert "\n" not in details and "Traceback" not in details, details
    assert "cuda_ipc" in details and "kv_transport.require" in details, details
    assert any(found in details for found in ("is shm", "is tcp")), details  # the transport it found
    wait_until(lambda: pools_are_full(strict.target), 60, "every block to be free")
    assert [p.num_replaced for p in strict.server.worker_set.pools()] == [0, 0]  # refused, not lost


def test_the_http_api_says_the_same(strict):
    resp = httpx.post(strict.http_url + "/v1/completions", timeout=300,
                      json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
    assert resp.status_code == 503, resp.text
    error = resp.json()["error"]
    assert error["code"] == "failed_precondition" and "cuda_ipc" in error["message"], error
