"""Frontends as a role of their own, on real processes: a scaled-out server (a control plane
actor and two frontend actors, each a process with its own gRPC and HTTP ports) over one
prefill and one decode worker of the small model. Two frontends serve at once with the
in-process engine's greedy tokens; a frontend SIGKILLed under load ends its own client's call
while the other's stream completes untouched, and the decode worker aborts the dead
frontend's request within its lease (seats and blocks free); its client, retrying on the
other frontend, is served; a new frontend joins and serves; the control plane SIGKILLed,
serving goes on and its restart adopts the same workers. One cluster for the module."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from pdserve.cluster.clients.admin_client import AdminClient
from pdserve.cluster.clients.credentials import ClientCredentials
from pdserve.cluster.clients.grpc_client import Client
from pdserve.cluster.scale_out import ScaledOut, launch_frontend, start_scaled_out
from pdserve.cluster.serving.mirror import FrontendInfo
from pdserve.cluster.settings.config import ServeConfig
from pdserve.engine.sampling import SamplingParams
from tests.cluster.conftest import _server_config
from tests.cluster.streams import collect, wait_until
from tests.engine.prompts import prompt_ids

pytestmark = pytest.mark.slow

ADMIN_TOKEN = "frontends-test-admin-token"
LEASE_BOUND_S = 30.0  # the bound on freeing a dead frontend's seats and blocks


@dataclass
class Cluster:
    scaled: ScaledOut
    loop: asyncio.AbstractEventLoop
    config: ServeConfig

    def run(self, coro: Any, timeout_s: float = 600.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def worker(self, worker_id: str) -> Any:
        import ray

        return ray.get_actor(f"worker-{worker_id}", namespace=self.config.ray.namespace)

    def admin(self, info: FrontendInfo) -> AdminClient:
        return AdminClient(target(info), ClientCredentials(api_key=ADMIN_TOKEN))


def target(info: FrontendInfo) -> str:
    return f"127.0.0.1:{info.port}"


@pytest.fixture(scope="module")
def cluster(ray_cluster, small_model, tmp_path_factory) -> Iterator[Cluster]:
    token = tmp_path_factory.mktemp("admin") / "token"
    token.write_text(ADMIN_TOKEN)
    config = _server_config(small_model, pools={"mode": "disaggregated"},
                            server={"frontends": 2, "metrics_port": 0, "admin_token_file": str(token)},
                            ray={"namespace": f"frontends-{uuid.uuid4().hex[:8]}"})
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    c = Cluster(asyncio.run_coroutine_threadsafe(start_scaled_out(config), loop).result(600), loop, config)
    yield c
    c.run(c.scaled.stop(), 120)
    loop.call_soon_threadsafe(loop.stop)


def _idle(cluster: Cluster) -> bool:
    import ray

    load = ray.get(cluster.worker("decode-0").load.remote(), timeout=30)
    return load.num_running + load.num_waiting + load.num_receiving == 0 and load.num_free_blocks == load.num_blocks


def test_two_frontends_serve_at_once_with_one_engines_greedy_tokens(cluster, engine, tokenizer):
    f0, f1 = cluster.scaled.infos
    assert f0.port != f1.port and f0.pid != f1.pid and f0.pid != os.getpid()
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [prompt_ids(tokenizer, 60, variant=v) for v in range(4)]
    want = [o.token_ids for o in engine.generate(prompts, params)]
    results: dict[int, list[int]] = {}

    def one(i: int) -> None:
        results[i] = collect(target((f0, f1)[i % 2]), prompts[i], params).token_ids

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert [results[i] for i in range(4)] == want
    with cluster.admin(f1) as admin:
        listing = admin.listing()
    assert {(f.id, f.pid, f.port, f.http_port) for f in listing.frontends} == \
        {(f.frontend_id, f.pid, f.port, f.http_port) for f in (f0, f1)}
    assert sorted(w.name for w in listing.workers) == ["decode-0", "prefill-0"]
    wait_until(lambda: _idle(cluster), 60, "the decode worker to free every block")


def test_a_sigkilled_frontend_ends_only_its_own_streams_and_its_seats_are_released(cluster, engine, tokenizer):
    import ray

    f0, f1 = cluster.scaled.infos
    survivor_prompt, victim_prompt = prompt_ids(tokenizer, 50, variant=7), prompt_ids(tokenizer, 50, variant=8)
    survivor_params = SamplingParams(temperature=0.0, max_tokens=600, ignore_eos=True)
    want = engine.generate([survivor_prompt], survivor_params)[0]
    # Long enough that it still runs when the lease runs out: only the lease ends it.
    victim_params = SamplingParams(temperature=0.0, max_tokens=8000 - 60, ignore_eos=True)
    started = {"survivor": threading.Event(), "victim": threading.Event()}
    got: dict[str, Any] = {}

    def stream(name: str, info: FrontendInfo, prompt: list[int], params: SamplingParams) -> None:
        ids, text = [], ""
        try:
            with Client(target(info)) as client:
                for resp in client.generate(prompt, params, timeout_s=600):
                    ids.extend(resp.token_ids)
                    text += resp.text
                    if len(ids) >= 4:
                        started[name].set()
            got[name] = (ids, text)
        except grpc.RpcError as e:
            got[name] = e
            started[name].set()

    threads = [threading.Thread(target=stream, args=("survivor", f1, survivor_prompt, survivor_params)),
               threading.Thread(target=stream, args=("victim", f0, victim_prompt, victim_params))]
    for t in threads:
        t.start()
    assert started["victim"].wait(120) and started["survivor"].wait(120)
    os.kill(f0.pid, signal.SIGKILL)
    for t in threads:
        t.join(600)
    # Its own client sees the connection end; the other frontend's stream is untouched.
    assert isinstance(got["victim"], grpc.RpcError) and got["victim"].code() == grpc.StatusCode.UNAVAILABLE
    assert got["survivor"] == (list(want.token_ids), want.text)
    # The decode worker aborts the dead frontend's request once its lease runs out: seats and blocks free.
    decode = cluster.worker("decode-0")
    wait_until(lambda: ray.get(decode.expired_leases.remote(), timeout=30).get(f0.frontend_id, 0) >= 1,
               LEASE_BOUND_S, "the decode worker to abort the dead frontend's request")
    wait_until(lambda: _idle(cluster), LEASE_BOUND_S, "the decode worker to free the dead frontend's seats and blocks")

    # Its client retries on the other frontend and is served.
    retry = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    assert collect(target(f1), victim_prompt, retry).token_ids == engine.generate([victim_prompt], retry)[0].token_ids

    # A new frontend joins and serves; the listing drops the dead one and shows the new one.
    fresh = launch_frontend(cluster.config, "f2", 2)
    cluster.scaled.frontends.append(fresh)
    f2 = ray.get(fresh.start.remote(cluster.scaled.control_plane), timeout=600)
    assert collect(target(f2), victim_prompt, retry).token_ids == engine.generate([victim_prompt], retry)[0].token_ids
    with cluster.admin(f2) as admin:
        wait_until(lambda: {f.id for f in admin.listing().frontends} == {"f1", "f2"}, LEASE_BOUND_S,
                   "the listing to show f1 and f2 only")


def test_serving_goes_on_while_the_control_plane_is_dead_and_its_restart_adopts_the_workers(cluster, engine,
                                                                                            tokenizer):
    import ray

    f1 = cluster.scaled.infos[1]
    control_plane = cluster.scaled.control_plane
    pid = ray.get(control_plane.pid.remote(), timeout=30)
    os.kill(pid, signal.SIGKILL)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompt = prompt_ids(tokenizer, 40, variant=11)
    assert collect(target(f1), prompt, params).token_ids == engine.generate([prompt], params)[0].token_ids
    # Ray restarts it; it adopts the running workers (no new ones started) and the frontends follow.
    wait_until(lambda: _answers(control_plane, pid), 120, "the control plane to restart")
    with cluster.admin(f1) as admin:
        wait_until(lambda: sorted(w.name for w in admin.listing().workers) == ["decode-0", "prefill-0"], 60,
                   "the restarted control plane to list the adopted workers")
    assert collect(target(f1), prompt, params).token_ids == engine.generate([prompt], params)[0].token_ids


def _answers(actor: Any, old_pid: int) -> bool:
    import ray

    try:
        return ray.get(actor.pid.remote(), timeout=10) != old_pid
    except Exception:  # noqa: BLE001 - restarting
        return False
