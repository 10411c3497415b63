"""What a client is told about a request that failed in a worker: one line, the cause's own
message, none of the Ray actor's traceback (which goes to the server's log).

Real Ray actors raise and die; a real disaggregated server (gRPC and the HTTP API, through
the grpc and httpx clients) fails a request in its prefill worker: a KV transport that
allows only CUDA IPC, which two CPU workers cannot use (SlowPathRefused, raised in the
actor, comes back through Ray as a RayTaskError whose text is the actor's traceback).
"""

from __future__ import annotations

import logging
import time

import grpc
import httpx
import pytest

from pdserve.cluster.clients.grpc_client import Client
from pdserve.cluster.serving.errors import cause, original
from pdserve.engine.sampling import SamplingParams
from pdserve.kv_transport import PeerLost, SlowPathRefused, TransferError

pytestmark = pytest.mark.slow

LEAKS = ("Traceback", 'File "', "ray::", "pid=", ".py", "\x1b")


def _safe(message: str) -> None:
    assert message and "\n" not in message and "\r" not in message, message
    for leak in LEAKS:
        assert leak not in message, (leak, message)


def _failing_actor():
    """An actor class, made here so that Ray ships it by value (the workers need not import tests)."""
    import ray

    class Failing:
        def fail(self, message: str) -> None:
            def deep() -> None:
                raise PeerLost(message)

            deep()

        def call_other(self, other) -> None:
            ray.get(other.fail.remote("connection to decode-0 lost: reset by peer"))

        def ping(self) -> int:
            return 1

    return ray.remote(num_cpus=0)(Failing)


@pytest.fixture(scope="module")
def actors(ray_cluster):
    import ray

    cls = _failing_actor()
    made = [cls.remote(), cls.remote()]
    yield made
    for a in made:
        ray.kill(a, no_restart=True)


def test_an_exception_raised_in_an_actor_is_told_by_its_own_message(actors):
    import ray

    with pytest.raises(TransferError) as raised:  # Ray's wrapper is still the original's class
        ray.get(actors[0].fail.remote("peer 127.0.0.1:1 refused"), timeout=60)
    # What Ray's text carries, and the client must not see: the actor's pid, its frames' files.
    assert 'File "' in str(raised.value) and "pid=" in str(raised.value)
    assert isinstance(original(raised.value), PeerLost)
    assert cause(raised.value) == "peer 127.0.0.1:1 refused"


def test_an_actor_failing_in_a_call_to_another_is_told_by_the_innermost_message(actors):
    import ray

    with pytest.raises(Exception) as raised:
        ray.get(actors[0].call_other.remote(actors[1]), timeout=60)
    assert cause(raised.value) == "connection to decode-0 lost: reset by peer"


def test_a_dead_actor_is_told_in_one_line(ray_cluster):
    import ray

    actor = _failing_actor().remote()
    ray.get(actor.ping.remote(), timeout=60)
    ray.kill(actor, no_restart=True)
    # ray.kill only asks: a call sent before the actor is gone may still be answered.
    deadline = time.monotonic() + 60
    with pytest.raises(ray.exceptions.RayActorError) as raised:
        while time.monotonic() < deadline:
            ray.get(actor.ping.remote(), timeout=60)
            time.sleep(0.05)
    _safe(cause(raised.value))
    assert "actor" in cause(raised.value)


def test_a_message_is_cut_to_its_first_line():
    assert cause(ValueError("first line\n  File \"/x.py\", line 1")) == "first line"
    assert cause(ValueError("")) == "ValueError"
    assert len(cause(ValueError("x" * 10_000))) <= 500


@pytest.fixture(scope="module")
def refusing(start):
    # Two CPU workers reach each other over shm or tcp, never CUDA IPC: every transfer is refused.
    return start(pools={"mode": "disaggregated"}, kv_transport={"allowed_transports": ["cuda_ipc"]})


def test_a_transfer_refused_in_the_prefill_worker_reaches_the_grpc_client_as_one_line(refusing, caplog):
    caplog.set_level(logging.WARNING, logger="pdserve")
    with Client(refusing.target) as client, pytest.raises(grpc.RpcError) as failed:
        list(client.generate("Hello there", SamplingParams(temperature=0.0, max_tokens=4), timeout_s=300))
    error = failed.value
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error  # a refused pair: the configuration
    _safe(error.details())
    assert "KV transfer to decode-0 failed" in error.details() and "cuda_ipc" in error.details()
    # The server's log has the whole of it: Ray's text with the prefill actor's traceback.
    logged = [r for r in caplog.records if r.exc_info and "KV transfer" in r.getMessage()]
    assert logged and "Traceback" in logging.Formatter().format(logged[0])
    assert isinstance(original(logged[0].exc_info[1]), SlowPathRefused)


def test_the_same_failure_reaches_the_http_client_as_one_line(refusing):
    resp = httpx.post(refusing.http_url + "/v1/completions", timeout=300,
                      json={"prompt": "Hello there", "max_tokens": 4, "temperature": 0})
    assert resp.status_code == 503, resp.text
    _safe(resp.json()["error"]["message"])
    assert "cuda_ipc" in resp.json()["error"]["message"]
    # Streamed, the error comes before the first token: the status line still says it.
    resp = httpx.post(refusing.http_url + "/v1/completions", timeout=300,
                      json={"prompt": "Hello there", "max_tokens": 4, "temperature": 0, "stream": True})
    assert resp.status_code == 503, resp.text
    _safe(resp.json()["error"]["message"])
