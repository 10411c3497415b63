"""A frontend process of a scaled-out server: gRPC, the HTTP API, tokenizing and detokenizing,
admission, routing and its own seats, streams and KV index, over the worker set the control
plane owns (`cluster/control_plane.py`), which it follows into mirror pools
(`cluster/serving/mirror.py`). Its requests' ids carry its id; its /metrics are its own.

`start_frontend` runs in any process with Ray joined: a `FrontendActor` (`pdserve serve
--frontends N` starts N of them, each a process and an event loop of its own) or the
`pdserve frontend --join` command's own process.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from typing import Any

import ray

from pdserve.cluster.api.admin_service import AdminService, RemoteElastic
from pdserve.cluster.api.frontend import Frontend
from pdserve.cluster.server import Apis, ApiSetup, log_serving, open_apis
from pdserve.cluster.serving.cluster_metrics import request_samples
from pdserve.cluster.serving.coordinator import Coordinator
from pdserve.cluster.serving.metrics import Metrics
from pdserve.cluster.serving.mirror import ControlPlaneLink, FrontendInfo, MirrorPool
from pdserve.cluster.serving.worker_set import WorkerSet
from pdserve.cluster.settings.config import ServeConfig

logger = logging.getLogger(__name__)


def nth_port(port: int, index: int) -> int:
    """Frontend `index`'s port of a base port (0 stays 0: a free one)."""
    return port + index if port else 0


@dataclass(slots=True)
class FrontendServer:
    info: FrontendInfo
    apis: Apis
    worker_set: WorkerSet
    link: ControlPlaneLink
    follow: asyncio.Task[None]
    metrics: Metrics
    grace_s: float

    async def stop(self) -> None:
        self.follow.cancel()
        await asyncio.gather(self.follow, return_exceptions=True)
        await self.apis.stop(self.grace_s)
        await self.worker_set.stop()  # its pollers and loops; the workers are the control plane's


async def start_frontend(config: ServeConfig, control_plane: Any, frontend_id: str, index: int) -> FrontendServer:
    """Frontend `frontend_id`, on `config`'s ports + `index`, over `control_plane`'s workers."""
    setup = ApiSetup.read(config)
    health = config.health
    link = ControlPlaneLink(control_plane, None, [])
    first = await link.refresh()
    roles = {m.role for m in first.members}
    decode = MirrorPool("mixed" if "mixed" in roles else "decode", health, link.report_lost)
    prefill = MirrorPool("prefill", health, link.report_lost) if "prefill" in roles else None
    link.mirrors = [p for p in (prefill, decode) if p is not None]
    for mirror in link.mirrors:
        await mirror.sync(list(first.members))
    metrics = Metrics()
    worker_set = WorkerSet(prefill, decode, config.pools.routing, config.engine.cache.block_size, metrics,
                           config.engine.scheduler.max_num_seqs, config.admission.max_waiting_per_worker,
                           config.coordinator, config.router, reader=frontend_id,
                           preempt_seats=config.engine.scheduler.policy == "priority",
                           lease_renew_s=config.worker.frontend_lease_s / 4)
    await worker_set.start(health.interval_s)
    coordinator = Coordinator(worker_set, config.engine.cache.block_size, metrics, config.coordinator)
    processor = setup.processor(config, await worker_set.max_model_len())
    frontend = Frontend(coordinator, worker_set, processor, metrics, config.server.default_timeout_s,
                        config.admission.retry_after_s, setup.tenants, frontend_id)
    try:
        apis = await open_apis(config, setup, frontend, AdminService(RemoteElastic(link)),
                               nth_port(config.server.port, index), nth_port(config.server.http_port, index))
    except BaseException:
        await worker_set.stop()
        raise
    metrics_port = nth_port(config.server.metrics_port, index)
    if metrics_port:
        metrics.serve(config.server.host, metrics_port)
    host = config.server.host if config.server.host not in ("0.0.0.0", "::") else ray.util.get_node_ip_address()
    link.me = FrontendInfo(frontend_id, os.getpid(), host, apis.port, apis.http.port if apis.http else 0,
                           metrics_port)
    link.samples = lambda: request_samples(metrics)  # summed with the other frontends' on the control plane
    await link.refresh()  # registered before anyone asks for it
    log_serving(config, setup, apis, coordinator.mode, f"pdserve frontend {frontend_id}")
    return FrontendServer(link.me, apis, worker_set, link, asyncio.create_task(link.follow()), metrics,
                          config.server.shutdown_grace_s)


class FrontendActor:
    """A frontend as a Ray actor: a process and an event loop of its own (`pdserve serve --frontends N`)."""

    def __init__(self, config: ServeConfig, frontend_id: str, index: int) -> None:
        self.config, self.frontend_id, self.index = config, frontend_id, index
        self.server: FrontendServer | None = None

    async def start(self, control_plane: Any) -> FrontendInfo:
        self.server = await start_frontend(self.config, control_plane, self.frontend_id, self.index)
        return self.server.info

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop()
