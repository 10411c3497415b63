"""Frontends as a role of their own, on real processes: a scaled-out server (a control plane
actor and two frontend actors, each a process with its own gRPC and HTTP ports) over one
prefill and one decode worker of the small model. Two frontends serve at once with the
in-process engine's greedy tokens; a frontend SIGKILLed under load ends its own client's call
while the other's stream completes untouched, and the decode worker aborts the dead
frontend's request within its lease (seats and blocks free); its client, retrying on the
other frontend, is served; a new frontend joins and serves; two more frontends SIGKILLed one
after the other under a burst lose no request silently and leak nothing, on either worker; the
control plane's /metrics sums the frontends' request metrics; the control plane SIGKILLed,
serving goes on and its restart adopts the same workers. One cluster for the module."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from pdserve.cluster.clients.admin_client import AdminClient
from pdserve.cluster.clients.credentials import ClientCredentials
from pdserve.cluster.clients.grpc_client import Client
from pdserve.cluster.frontend_server import FrontendServer
from pdserve.cluster.scale_out import ScaledOut, join, start_scaled_out
from pdserve.cluster.serving.mirror import FrontendInfo
from pdserve.cluster.settings.config import ServeConfig
from pdserve.engine.sampling import SamplingParams
from tests.cluster.conftest import _server_config
from tests.cluster.streams import collect, free_port, serve_process, wait_until
from tests.engine.prompts import prompt_ids

pytestmark = pytest.mark.slow

ADMIN_TOKEN = "frontends-test-admin-token"
LEASE_BOUND_S = 30.0  # the bound on freeing a dead frontend's seats and blocks


@dataclass
class Cluster:
    scaled: ScaledOut
    loop: asyncio.AbstractEventLoop
    config: ServeConfig
    joined: list[FrontendServer] = field(default_factory=list)  # frontends that joined in this process

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
    for server in c.joined:
        c.run(server.stop(), 60)
    c.run(c.scaled.stop(), 120)
    loop.call_soon_threadsafe(loop.stop)


def test_pdserve_serve_with_two_frontends_lists_them_serves_on_each_and_stops_them(small_model, engine, tokenizer,
                                                                                  tmp_path):
    """`pdserve serve --frontends 2` as a process of its own: frontend i on --port + i,
    `pdserve workers` lists both (id, pid, host, ports), each serves the engine's greedy
    tokens, and SIGTERM stops every frontend process."""
    import psutil

    token = tmp_path / "admin-token"
    token.write_text(ADMIN_TOKEN)
    port = free_port()
    cli = [sys.executable, "-m", "pdserve.cluster.cli"]
    serve = [*cli, "serve", "--frontends", "2", "--port", str(port), "--http-port", str(free_port()),
             "--metrics-port", "0", "--admin-token-file", str(token), "--engine.model.source", str(small_model.folder),
             "--engine.model.device", "cpu", "--engine.model.dtype", "float32",
             "--engine.cache.cpu_kv_cache_gib", "0.25", "--pools.gpus_per_worker", "0"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompt = prompt_ids(tokenizer, 30, variant=3)
    want = engine.generate([prompt], params)[0].token_ids
    with serve_process(serve) as proc:
        listed = subprocess.run([*cli, "workers", "--target", f"127.0.0.1:{port}", "--admin-token-file", str(token)],
                                capture_output=True, text=True, timeout=120)
        assert listed.returncode == 0, listed.stderr
        frontends = [line.split() for line in listed.stdout.splitlines() if " frontend " in line]
        # "f0  frontend pid PID  host HOST  gRPC PORT  HTTP PORT  metrics off"
        assert sorted((f[0], f[5], f[7]) for f in frontends) == \
            [("f0", "127.0.0.1", str(port)), ("f1", "127.0.0.1", str(port + 1))], listed.stdout
        pids = [int(f[3]) for f in frontends]
        assert all(psutil.pid_exists(pid) for pid in pids) and proc.pid not in pids
        for i in range(2):
            assert collect(f"127.0.0.1:{port + i}", prompt, params).token_ids == want
        # `pdserve frontend --join ADDRESS --namespace NS`, as the serving line says, from a process of its own.
        join_command = re.search(r"pdserve frontend --join (\S+) --namespace (\S+)`", proc.serving_line)
        assert join_command, proc.serving_line
        joined_port = free_port()
        joined = subprocess.Popen([*cli, "frontend", "--join", join_command[1], "--namespace", join_command[2],
                                   "--port", str(joined_port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, start_new_session=True)
        try:
            wait_until(lambda: _listed_frontends(port, token) == 3, 180, "the joined frontend to be listed")
            assert collect(f"127.0.0.1:{joined_port}", prompt, params).token_ids == want
        finally:
            joined.send_signal(signal.SIGTERM)
            output = joined.communicate(timeout=60)[0]
        assert joined.returncode == 0, output[-3000:]
    assert proc.returncode == 0
    wait_until(lambda: not any(psutil.pid_exists(pid) for pid in pids), 30, "the frontend processes to end")


def _stream(got: dict[Any, Any], key: Any, info: FrontendInfo, prompt: list[int], params: SamplingParams,
            started: threading.Event | None = None, after: int = 1) -> None:
    """One streamed request into `got[key]`: (token ids, text), or the RpcError that ended it;
    `started` set once `after` tokens came (or at the error)."""
    ids, text = [], ""
    try:
        with Client(target(info)) as client:
            for resp in client.generate(prompt, params, timeout_s=600):
                ids.extend(resp.token_ids)
                text += resp.text
                if started is not None and len(ids) >= after:
                    started.set()
        got[key] = (ids, text)
    except grpc.RpcError as e:
        got[key] = e
        if started is not None:
            started.set()


def _listed_frontends(port: int, token: Path) -> int:
    with AdminClient(f"127.0.0.1:{port}", ClientCredentials(api_key=token.read_text())) as admin:
        return len(admin.listing().frontends)


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
        want_listed = {(f.frontend_id, f.pid, f.port, f.http_port) for f in (f0, f1)}
        # The listing is f1's copy of the control plane's registry: fresh within a heartbeat or two.
        wait_until(lambda: {(f.id, f.pid, f.port, f.http_port) for f in admin.listing().frontends} == want_listed,
                   30, "f1 to list both frontends")
        assert sorted(w.name for w in admin.listing().workers) == ["decode-0", "prefill-0"]
    wait_until(lambda: _idle(cluster), 60, "the decode worker to free every block")
    # The control plane's /metrics sums both frontends' request metrics (their heartbeats carry them).
    wait_until(lambda: _cluster_sample(cluster, 'pdserve_cluster_requests_total{status="OK"}') == 4, 30,
               "the cluster view to count the four requests")
    assert _cluster_sample(cluster, "pdserve_cluster_generated_tokens_total") == 4 * 40
    assert _cluster_sample(cluster, "pdserve_cluster_time_to_first_token_seconds_count") == 4


def _cluster_sample(cluster: Cluster, name: str) -> float | None:
    import ray

    text = ray.get(cluster.scaled.control_plane.metrics_text.remote(), timeout=30)
    return next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " ")), None)


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
        _stream(got, name, info, prompt, params, started[name], 4)

    def http_stream() -> None:
        """An OpenAI streamed completion on the victim frontend's HTTP port."""
        import openai

        n = 0
        try:
            with openai.OpenAI(base_url=f"http://127.0.0.1:{f0.http_port}/v1", api_key="unused", max_retries=0,
                               timeout=600) as client:
                model = client.models.list().data[0].id
                for _ in client.completions.create(model=model, prompt=victim_prompt, max_tokens=8000 - 60,
                                                   temperature=0, stream=True, extra_body={"ignore_eos": True}):
                    n += 1
                    if n >= 4:
                        started["http"].set()
            got["http"] = "ended"  # the stream ended as if complete: the cut was not seen
        except Exception as e:  # noqa: BLE001 - the cut, as the client library reports it
            got["http"] = e
            started["http"].set()

    started["http"] = threading.Event()
    threads = [threading.Thread(target=stream, args=("survivor", f1, survivor_prompt, survivor_params)),
               threading.Thread(target=stream, args=("victim", f0, victim_prompt, victim_params)),
               threading.Thread(target=http_stream)]
    for t in threads:
        t.start()
    assert all(e.wait(120) for e in started.values())
    os.kill(f0.pid, signal.SIGKILL)
    for t in threads:
        t.join(600)
    # Its own clients see the connection end (gRPC UNAVAILABLE, the HTTP stream cut); the other
    # frontend's stream is untouched.
    assert isinstance(got["victim"], grpc.RpcError) and got["victim"].code() == grpc.StatusCode.UNAVAILABLE
    assert isinstance(got["http"], Exception), got["http"]
    assert got["survivor"] == (list(want.token_ids), want.text)
    # The decode worker aborts the dead frontend's request once its lease runs out: seats and blocks free.
    decode = cluster.worker("decode-0")
    wait_until(lambda: ray.get(decode.expired_leases.remote(), timeout=30).get(f0.frontend_id, 0) >= 2,
               LEASE_BOUND_S, "the decode worker to abort the dead frontend's requests")
    wait_until(lambda: _idle(cluster), LEASE_BOUND_S, "the decode worker to free the dead frontend's seats and blocks")
    assert ray.get(decode.expired_leases.remote(), timeout=30) == {f0.frontend_id: 2}  # its two, nobody else's

    # Its client retries on the other frontend and is served.
    retry = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    assert collect(target(f1), victim_prompt, retry).token_ids == engine.generate([victim_prompt], retry)[0].token_ids

    # A new frontend joins (as `pdserve frontend --join` does, here in this process) and serves;
    # the listing drops the dead one and shows the new one.
    joined = cluster.run(join(None, cluster.config.ray.namespace, "127.0.0.1",
                              {"port": 0, "http_port": 0, "metrics_port": 0}))
    cluster.joined.append(joined)
    fresh = joined.info
    assert collect(target(fresh), victim_prompt, retry).token_ids == \
        engine.generate([victim_prompt], retry)[0].token_ids
    with cluster.admin(fresh) as admin:
        wait_until(lambda: {f.id for f in admin.listing().frontends} == {"f1", fresh.frontend_id},
                   3 * 10 + LEASE_BOUND_S, "the listing to show f1 and the new frontend only")


def test_two_frontends_killed_one_after_the_other_under_load_lose_nothing_silently_and_leak_nothing(
        cluster, engine, tokenizer):
    """Two more frontend processes take a burst each (requests in every stage: queued for a seat,
    prefilling, their KV on the wire, decoding) and are SIGKILLed one after the other while a
    third frontend streams: every request on them either completed with the engine's greedy
    tokens or ended with UNAVAILABLE (none cut short as if complete), the survivor's stream is
    untouched, both workers free every block and seat within the lease, the prefill worker
    holding nothing for the dead, and the failed requests retried on the survivor are served."""
    import ray

    from pdserve.cluster.scale_out import launch_frontend

    f1 = cluster.scaled.infos[1]
    config = dataclasses.replace(cluster.config, server=dataclasses.replace(cluster.config.server, port=0,
                                                                              http_port=0, metrics_port=0))
    dead = [launch_frontend(config, fid, 0) for fid in ("k1", "k2")]

    async def start() -> list[FrontendInfo]:
        return list(await asyncio.gather(*(f.start.remote(cluster.scaled.control_plane) for f in dead)))

    infos = cluster.run(start(), 300)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    prompts = [prompt_ids(tokenizer, 200 + 40 * v, variant=20 + v) for v in range(8)]
    want = [o.token_ids for o in engine.generate(prompts, params)]
    survivor_params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    survivor_prompt = prompt_ids(tokenizer, 60, variant=30)
    survivor_want = engine.generate([survivor_prompt], survivor_params)[0]
    got: dict[int, Any] = {}
    first_token = [threading.Event() for _ in prompts]

    def one(i: int, info: FrontendInfo, prompt: list[int], p: SamplingParams) -> None:
        _stream(got, i, info, prompt, p, first_token[i] if i >= 0 else None)

    threads = [threading.Thread(target=one, args=(i, infos[i % 2], prompts[i], params)) for i in range(len(prompts))]
    threads.append(threading.Thread(target=one, args=(-1, f1, survivor_prompt, survivor_params)))
    for t in threads:
        t.start()
    assert first_token[0].wait(120)  # k1 streams; its other requests are wherever they are
    os.kill(infos[0].pid, signal.SIGKILL)
    assert first_token[1].wait(120)
    os.kill(infos[1].pid, signal.SIGKILL)
    for t in threads:
        t.join(600)
    assert got[-1] == (list(survivor_want.token_ids), survivor_want.text)
    failed = []
    for i in range(len(prompts)):
        if isinstance(got[i], grpc.RpcError):
            assert got[i].code() == grpc.StatusCode.UNAVAILABLE, got[i]
            failed.append(i)
        else:
            assert got[i][0] == want[i], f"request {i} ended as if complete with other tokens"
    assert failed, "no request was caught by the kills"
    wait_until(lambda: _idle(cluster) and _prefill_idle(cluster), LEASE_BOUND_S,
               "the workers to free the dead frontends' seats and blocks")
    prefill_cuts = ray.get(cluster.worker("prefill-0").expired_leases.remote(), timeout=30)
    assert set(prefill_cuts) <= {"k1", "k2"}, prefill_cuts
    for i in failed:  # the clients retry on the survivor
        assert collect(target(f1), prompts[i], params).token_ids == want[i]
    for f in dead:
        ray.kill(f, no_restart=True)


def _prefill_idle(cluster: Cluster) -> bool:
    import ray

    load = ray.get(cluster.worker("prefill-0").load.remote(), timeout=30)
    return load.num_running + load.num_waiting + load.num_held == 0 and load.num_free_blocks == load.num_blocks


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
        # Elastic changes go through a frontend to the control plane again; its worker ids go on after
        # the adopted ones, and every frontend's copy follows.
        assert admin.add_worker("decode", timeout_s=300).name == "decode-1"
        wait_until(lambda: "decode-1" in {w.name for w in admin.listing().workers}, 30, "f1 to list decode-1")


def _answers(actor: Any, old_pid: int) -> bool:
    import ray

    try:
        return ray.get(actor.pid.remote(), timeout=10) != old_pid
    except Exception:  # noqa: BLE001 - restarting
        return False
