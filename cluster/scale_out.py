"""Starting and stopping a scaled-out server (`pdserve serve --frontends N`, `--control-plane`)
and joining one (`pdserve frontend --join`): the driver starts the control plane, then the
frontends, and stops them on Ctrl-C. It serves nothing itself."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
from dataclasses import dataclass
from typing import Any

import ray

from pdserve.cluster.control_plane import CONTROL_PLANE_NAME, ControlPlane
from pdserve.cluster.frontend_server import FrontendActor, FrontendServer, start_frontend
from pdserve.cluster.ray_driver import init_ray
from pdserve.cluster.server import ApiSetup, check_splits_of
from pdserve.cluster.serving.mirror import FrontendInfo
from pdserve.cluster.serving.pools import WORKER_NAME_PREFIX
from pdserve.cluster.settings.config import ServeConfig
from pdserve.cluster.settings.secrets import cluster_secret

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0  # bound on each frontend's and the control plane's stop


@dataclass(slots=True)
class ScaledOut:
    control_plane: Any  # the ControlPlane actor's handle
    frontends: list[Any]  # FrontendActor handles, in index order
    infos: list[FrontendInfo]

    namespace: str

    async def stop(self) -> None:
        await asyncio.gather(*(asyncio.wait_for(f.stop.remote(), STOP_TIMEOUT_S) for f in self.frontends),
                             return_exceptions=True)
        for f in self.frontends:
            ray.kill(f, no_restart=True)
        try:
            await asyncio.wait_for(self.control_plane.stop.remote(), STOP_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - dead or stuck: its workers are killed by name below
            logger.warning("control plane did not stop its workers (%s); killing them", type(e).__name__)
        finally:
            ray.kill(self.control_plane, no_restart=True)
            kill_workers(self.namespace)


def kill_workers(namespace: str) -> None:
    """Kill the workers named in `namespace` that are still there: they are detached, so nothing
    else ends them on a cluster that outlives this server (a stop mid-start, a dead control plane)."""
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["namespace"] == namespace and a["name"].startswith(WORKER_NAME_PREFIX):
            try:
                ray.kill(ray.get_actor(a["name"], namespace=namespace), no_restart=True)
            except ValueError:  # gone meanwhile
                pass


def start_control_plane(config: ServeConfig) -> Any:
    """The control plane actor, restarted by Ray if its process dies (it adopts its workers)."""
    metrics_port = config.server.metrics_port + config.server.frontends if config.server.metrics_port else 0
    cls = ray.remote(ControlPlane)
    return cls.options(name=CONTROL_PLANE_NAME, namespace=config.ray.namespace, max_restarts=-1, num_cpus=0,
                       max_concurrency=1000).remote(config, metrics_port, cluster_secret())


def launch_frontend(config: ServeConfig, frontend_id: str, index: int) -> Any:
    """A frontend actor (not started: call its `start(control_plane)`). Not restarted by Ray:
    a dead frontend's clients retry on another, and a new one joins."""
    cls = ray.remote(FrontendActor)
    return cls.options(name=f"frontend-{frontend_id}", namespace=config.ray.namespace, max_restarts=0, num_cpus=0,
                       max_concurrency=1000).remote(config, frontend_id, index)


async def start_scaled_out(config: ServeConfig) -> ScaledOut:
    check_splits_of(config, ApiSetup.read(config))  # bad input fails before anything starts
    init_ray(config.ray.address, config.ray.node_ip_address)
    control_plane = start_control_plane(config)
    frontends: list[Any] = []
    try:
        await control_plane.start.remote()
        frontends = [launch_frontend(config, f"f{i}", i) for i in range(config.server.frontends)]
        infos = list(await asyncio.gather(*(f.start.remote(control_plane) for f in frontends)))
    except BaseException:
        await ScaledOut(control_plane, frontends, [], config.ray.namespace).stop()
        raise
    return ScaledOut(control_plane, frontends, infos, config.ray.namespace)


async def serve_scaled_out_forever(config: ServeConfig) -> None:
    scaled = await start_scaled_out(config)
    for f in scaled.infos:
        http = f", OpenAI HTTP API on http://{f.host}:{f.http_port}/v1" if f.http_port else ""
        print(f"pdserve: frontend {f.frontend_id} (pid {f.pid}): gRPC on {f.host}:{f.port}{http}", flush=True)
    address = ray.get_runtime_context().gcs_address
    print(f"pdserve: serving with {len(scaled.infos)} frontend(s) (control plane {CONTROL_PLANE_NAME!r} in Ray "
          f"namespace {config.ray.namespace!r}; more join with `pdserve frontend --join {address} --namespace "
          f"{config.ray.namespace}`); Ctrl-C stops", flush=True)
    await _until_signal()
    await scaled.stop()  # Ray ends with the command (cli: ray_driver.ray_ending_with)


async def join(address: str | None, namespace: str, node_ip_address: str, overrides: dict[str, Any]) -> FrontendServer:
    """A frontend in this process, joining the server whose control plane runs in `namespace` of
    the Ray cluster at `address` (None: the one this process has joined already); it serves that
    server's config, its `server` fields replaced by `overrides` (host, ports)."""
    init_ray(address, node_ip_address, host_token=True, namespace=namespace)
    control_plane = ray.get_actor(CONTROL_PLANE_NAME, namespace=namespace)
    config: ServeConfig = await control_plane.serve_config.remote()
    config = dataclasses.replace(config, server=dataclasses.replace(config.server, **overrides))
    frontend_id = await control_plane.new_frontend_id.remote()
    return await start_frontend(config, control_plane, frontend_id, 0)


async def join_forever(address: str, namespace: str, node_ip_address: str, overrides: dict[str, Any]) -> None:
    server = await join(address, namespace, node_ip_address, overrides)
    f = server.info
    print(f"pdserve: frontend {f.frontend_id} joined; serving gRPC on {f.host}:{f.port}"
          f"{f', HTTP on {f.host}:{f.http_port}' if f.http_port else ''}; Ctrl-C stops", flush=True)
    await _until_signal()
    await server.stop()  # this process's Ray connection ends with the command (ray_ending_with)


async def _until_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
