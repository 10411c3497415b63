"""The disaggregation failures peers' users report, proven absent on real processes: real Ray
actors (two prefill workers, one decode worker), real UCX between them (shm/TCP on the CPU),
real gRPC and HTTP clients. Each request's greedy tokens are the in-process engine's (an
undisturbed run), and afterwards the decode worker holds no block, no pending transfer and no
landing.

- sustained load: many small transfers, none failing (sglang#23272);
- the cluster idle past every keep-alive and timeout (made short here), then a burst (sglang#9926);
- a transfer cut midway (kv_transport/faults.py, injected into the prefill workers' senders):
  a payload cut short, the UCX link closed, a prefill side that never posts its data
  (vllm#52234, vllm#50754): the request is retried, never answered with wrong tokens;
- a prefill worker SIGKILLed while its KV is on the wire: the request completes through the
  other prefill worker.

- a peer with the cluster's secret sending the decode worker malformed or truncated transfer
  metadata: refused, and the decode worker serves the next request (the transport's own
  tests: tests/kv_transport/test_ucx_faults.py).
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pdserve.cluster.clients.grpc_client import Client
from pdserve.engine.sampling import SamplingParams
from pdserve.kv_transport.faults import TransferFault
from pdserve.proto.v1 import generation_pb2 as pb
from tests.cluster.streams import collect, pools_are_full, wait_until
from tests.engine.prompts import prompt_ids
from tests.kv_transport.peers import PeerSpec
from tests.kv_transport.test_ucx_faults import MALFORMED
from tests.kv_transport.test_ucx_processes import peers

pytestmark = pytest.mark.slow

TRANSFER_TIMEOUT_S = 4.0  # the KV transport's bounds, short: the idle test outwaits every one
IDLE_S = 6.5  # past the transport's bounds, the health pings and uvicorn's 5 s keep-alive
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def srv(start):
    return start(pools={"mode": "disaggregated", "num_prefill": 2, "num_decode": 1},
                 kv_transport={"transfer_timeout_s": TRANSFER_TIMEOUT_S, "connect_timeout_s": TRANSFER_TIMEOUT_S},
                 health={"interval_s": 0.5}, coordinator={"poll_wait_s": 0.2})


def _call(worker, fn, *args):
    import ray

    return ray.get(worker.actor.__ray_call__.remote(fn, *args), timeout=60)


def _inject(srv, fault: TransferFault | None) -> None:
    for w in srv.server.worker_set.prefill.workers:
        _call(w, lambda self, f: self._sender.inject(f), fault)


def _faults_hit(worker) -> int:
    return _call(worker, lambda self: self._sender.faults_hit)


def _counter(srv, name: str) -> float:
    return sum(s.value for m in srv.server.metrics.registry.collect() for s in m.samples if s.name == name)


def _decode_holds_nothing(srv) -> None:
    """Every block free on every worker, nothing running; the decode worker's receiver has no
    transfer pending and the worker no landing it waits for."""
    wait_until(lambda: pools_are_full(srv.target), 60, "every block to be free")
    [decode] = srv.server.worker_set.decode.workers
    assert _call(decode, lambda self: (self._receiver.num_pending, len(self._landing))) == (0, 0)


def _want(engine, prompts, params=GREEDY) -> list[list[int]]:
    return [out.token_ids for out in engine.generate(prompts, params)]


def test_sustained_small_transfers_all_land(srv, engine, tokenizer):
    """192 requests, 16 at a time, prompts of 5 to 40 tokens (1-3 blocks each): every one served
    with the engine's tokens, each by one KV transfer, none retried."""
    prompts = [prompt_ids(tokenizer, 5 + i % 36, variant=i) for i in range(192)]
    want = _want(engine, prompts)
    transfers, migrations = _counter(srv, "pdserve_kv_transfer_seconds_count"), _counter(
        srv, "pdserve_request_migrations_total")
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda p: collect(srv.target, p, GREEDY).token_ids, prompts))
    assert got == want
    assert _counter(srv, "pdserve_kv_transfer_seconds_count") - transfers == len(prompts)
    assert _counter(srv, "pdserve_request_migrations_total") == migrations
    _decode_holds_nothing(srv)


def test_a_burst_after_idling_past_every_timeout_is_served(srv, engine, tokenizer):
    """One request over a gRPC channel and a pooled HTTP connection, then both idle past the
    transport's timeouts and keep-alives, the health pings' bounds and uvicorn's keep-alive
    (which closes the idle HTTP connection); then a burst over the same channel and client:
    all served, with the engine's tokens."""
    prompts = [prompt_ids(tokenizer, 20, variant=100 + i) for i in range(16)]
    want = _want(engine, prompts)
    text_want = engine.generate(["Name three colours."], GREEDY)[0].text
    body = {"prompt": "Name three colours.", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    with Client(srv.target) as client, httpx.Client(base_url=srv.http_url, timeout=120) as http:

        def grpc_tokens(prompt) -> list[int]:
            return [t for r in client.generate(prompt, GREEDY, timeout_s=120) for t in r.token_ids]

        assert grpc_tokens(prompts[0]) == want[0]
        assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == text_want
        time.sleep(IDLE_S)
        with ThreadPoolExecutor(16) as pool:
            grpc_burst = pool.map(grpc_tokens, prompts)
            http_burst = [pool.submit(http.post, "/v1/completions", json=body) for _ in range(4)]
            assert list(grpc_burst) == want
            for resp in http_burst:
                assert resp.result().status_code == 200 and resp.result().json()["choices"][0]["text"] == text_want
    _decode_holds_nothing(srv)


@pytest.mark.parametrize("fault", [TransferFault("truncate", after_blocks=1), TransferFault("close"),
                                   TransferFault("stall")], ids=["cut-short", "link-closed", "never-posted"])
def test_a_transfer_cut_midway_is_retried_never_answered_with_wrong_tokens(srv, engine, tokenizer, fault):
    """Both prefill workers' senders break their next transfer: the request's KV fails to land
    (refused as short, its link lost, or never sent and bounded by the timeout), the decode
    worker frees its blocks, and the request is retried: the client gets exactly the engine's
    tokens, one migration per broken transfer."""
    prompt = prompt_ids(tokenizer, 40, variant=200 + len(fault.action))
    [want] = _want(engine, [prompt])
    migrations = _counter(srv, "pdserve_request_migrations_total")
    prefill = srv.server.worker_set.prefill.workers
    hits = [_faults_hit(w) for w in prefill]
    _inject(srv, fault)
    try:
        got = collect(srv.target, prompt, GREEDY, 120)
    finally:
        _inject(srv, None)
    broken = sum(_faults_hit(w) for w in prefill) - sum(hits)
    assert got.token_ids == want and got.finish_reason == pb.FINISH_REASON_LENGTH
    assert broken >= 1 and _counter(srv, "pdserve_request_migrations_total") - migrations == broken
    _decode_holds_nothing(srv)
    assert collect(srv.target, prompt, GREEDY).token_ids == want  # and the next request is fine


def test_a_request_whose_every_transfer_is_cut_fails_clearly(srv, engine, tokenizer):
    """Every transfer cut short, the first attempt's and each retry's: after
    `coordinator.max_migrations` retries the client gets UNAVAILABLE naming the cut, no
    tokens of a failed transfer; the decode worker holds nothing and the next request is fine."""
    import grpc

    prompt = prompt_ids(tokenizer, 40, variant=500)
    _inject(srv, TransferFault("truncate", after_blocks=1, times=100))
    try:
        with pytest.raises(grpc.RpcError) as failed:
            collect(srv.target, prompt, GREEDY, 120)
    finally:
        _inject(srv, None)
    error = failed.value
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error
    assert "ended short of the 3 blocks" in error.details() and "gave up after 4 attempts" in error.details(), error
    _decode_holds_nothing(srv)
    assert collect(srv.target, prompt, GREEDY).token_ids == _want(engine, [prompt])[0]


def test_malformed_transfer_metadata_is_refused_and_the_decode_worker_serves_on(srv, engine, tokenizer):
    """A process that holds the cluster's secret and the decode worker's KV layout (it passes
    the handshake) sends transfer headers with bad, missing or mistyped fields and frames cut
    short or not JSON: each connection is refused with the reason; the decode worker then serves
    a request with the engine's tokens and holds nothing."""
    [decode] = srv.server.worker_set.decode.workers
    layout = _call(decode, lambda self: self.loop.engine.kv_wire_layout)
    secret = srv.server.worker_set.prefill.spec.args[1].secret
    spec = PeerSpec(secret=secret, wire_layout=layout, num_blocks=4, timeout_s=TRANSFER_TIMEOUT_S)
    with peers(("stranger", spec)) as (stranger,):
        stranger.command("malformed", peer=decode.address, frames=[frame for frame, _ in MALFORMED])
        errors = stranger._next("malformed", len(MALFORMED) * 2 * TRANSFER_TIMEOUT_S)["errors"]
    for (frame, words), error in zip(MALFORMED, errors):
        assert error.startswith("TransferRejected") and words in error, (frame, error)
    prompt = prompt_ids(tokenizer, 30, variant=400)
    assert collect(srv.target, prompt, GREEDY).token_ids == _want(engine, [prompt])[0]
    _decode_holds_nothing(srv)


def test_a_prefill_worker_sigkilled_while_its_kv_is_on_the_wire(srv, engine, tokenizer):
    """Four requests at once; a prefill worker has announced one request's KV to the decode
    worker (which waits for it) when its process is SIGKILLed: the decode worker's receive fails
    with the lost peer and its blocks are freed; every request completes (through the other
    prefill worker, or the killed one's replacement) with the undisturbed run's tokens."""
    import ray

    prompts = [prompt_ids(tokenizer, 40, variant=300 + i) for i in range(4)]
    want = _want(engine, prompts)
    pool = srv.server.worker_set.prefill
    [decode] = srv.server.worker_set.decode.workers
    hits = {w.worker_id: _faults_hit(w) for w in pool.workers}
    # The KV stays on the wire: its header is sent, its data is held back (until the timeout).
    _inject(srv, TransferFault("stall"))
    with ThreadPoolExecutor(len(prompts)) as threads:
        got = [threads.submit(collect, srv.target, p, GREEDY, 120) for p in prompts]
        wait_until(lambda: any(_faults_hit(w) > hits[w.worker_id] for w in pool.workers), 60,
                   "a prefill worker to announce the KV and hold it back")
        victim = next(w for w in pool.workers if _faults_hit(w) > hits[w.worker_id])
        for w in pool.workers:
            if w is not victim:
                _call(w, lambda self: self._sender.inject(None))
        assert _call(decode, lambda self: self._receiver.num_pending) >= 1  # the decode worker waits for it
        os.kill(_call(victim, lambda self: os.getpid()), signal.SIGKILL)
        for future, tokens in zip(got, want):
            out = future.result(120)
            assert out.token_ids == tokens and out.finish_reason == pb.FINISH_REASON_LENGTH
    wait_until(lambda: victim not in pool.workers and all(w.state.healthy for w in pool.workers), 120,
               "the pool to replace the killed prefill worker")
    with pytest.raises(ray.exceptions.RayActorError):
        _faults_hit(victim)
    _decode_holds_nothing(srv)
