"""The control plane of a scaled-out server (`pdserve serve --frontends N`): the one owner of the
worker set, apart from the frontends (`docs/architecture.md`, "What is shared and who owns it").

`ControlPlane` runs as a named Ray actor with a restart policy. It starts the pools (their
workers detached and named in its namespace, so that they outlive it), pings and replaces
workers, runs the admin API's changes (`Elastic`) and the planner (over the frontends' request
metrics, which their heartbeats carry: `serving/cluster_metrics.py`, summed on its /metrics as
`pdserve_cluster_*`), and publishes the membership the frontends
follow (`Membership`: a version that moves when a worker joins, leaves or changes phase;
answered as a long poll). A restarted control plane adopts the workers it finds by name
instead of starting new ones. It serves no request: the frontends do.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from typing import Any

import ray

from pdserve.cluster.scaling.elastic import Elastic
from pdserve.cluster.scaling.planner import Planner
from pdserve.cluster.scaling.planner_loop import PlannerLoop
from pdserve.cluster.server import build_planner, build_pools
from pdserve.cluster.serving.cluster_metrics import CLUSTER_PREFIX, ClusterRequestMetrics, Sample
from pdserve.cluster.serving.metrics import Metrics
from pdserve.cluster.serving.mirror import HEARTBEAT_S, FrontendInfo, Membership
from pdserve.cluster.serving.pools import WORKER_NAME_PREFIX, Pool
from pdserve.cluster.serving.worker_set import WorkerSet
from pdserve.cluster.settings.config import ServeConfig

logger = logging.getLogger(__name__)

CONTROL_PLANE_NAME = "control-plane"
READER = "control-plane"  # its KV-event cursor on the workers
ADMIN_METHODS = ("drain", "add", "remove", "change_role")
POLL_STEP_S = 0.2  # how often a membership long poll looks for a change


class ControlPlane:
    def __init__(self, config: ServeConfig, metrics_port: int = 0, secret: bytes | None = None) -> None:
        """`secret`: the workers' cluster secret, chosen once by the driver: a restarted control
        plane's new workers must share it with the adopted ones (None: `cluster_secret()`)."""
        self.config = config
        self.metrics_port = metrics_port
        self.secret = secret
        self.incarnation = uuid.uuid4().hex  # fresh at each (re)start: the frontends resync
        self._version = 0
        self._fingerprint: tuple | None = None
        self._frontends: dict[str, tuple[FrontendInfo, float]] = {}
        self._started: asyncio.Future[None] | None = None
        self.worker_set: WorkerSet | None = None
        self.elastic: Elastic | None = None
        self.metrics = Metrics()
        self.cluster_metrics = ClusterRequestMetrics(self.metrics)
        self.metrics.registry.register(self.cluster_metrics)
        self._planner: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """The pools started (or, after a restart, adopted), checked and read from now on."""
        if self._started is None:
            self._started = asyncio.ensure_future(self._start())
        await asyncio.shield(self._started)

    async def _start(self) -> None:
        config = self.config
        planner = build_planner(config)  # a bad profile fails before any worker starts
        prefill, decode = build_pools(config, config.ray.namespace, self.secret)
        await self._adopt([p for p in (prefill, decode) if p is not None])
        metrics = self.metrics
        self.worker_set = WorkerSet(prefill, decode, config.pools.routing, config.engine.cache.block_size, metrics,
                                    config.engine.scheduler.max_num_seqs, config.admission.max_waiting_per_worker,
                                    config.coordinator, config.router, reader=READER, places_requests=False)
        await self.worker_set.start(config.health.interval_s)
        self.elastic = Elastic(self.worker_set, config.drain)
        if self.metrics_port:
            metrics.serve(config.server.host, self.metrics_port)
        if planner is not None and self.worker_set.mode == "disaggregated":
            self._planner = asyncio.create_task(self._run_planner(planner))
        elif planner is not None:
            logger.warning("pools.planner: this server is colocated: the planner stays off")

    async def _run_planner(self, planner: Planner) -> None:
        """The planner over the frontends' summed request metrics, from once every live frontend
        has reported (a restarted control plane starts with no report: counting from nothing,
        its first interval would see every request the frontends ever served)."""
        await asyncio.sleep(2 * HEARTBEAT_S)
        assert self.worker_set is not None and self.elastic is not None
        await PlannerLoop(planner, self.config.pools.planner, self.worker_set, self.elastic, self.metrics,
                          CLUSTER_PREFIX).run()

    async def _adopt(self, pools: list[Pool]) -> None:
        """The workers a control plane before this one started, found by name, become the pools'."""
        namespace = self.config.ray.namespace
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == namespace and a["name"].startswith(WORKER_NAME_PREFIX)]
        found: dict[str, list] = {p.role: [] for p in pools}
        for name in names:
            try:
                actor = ray.get_actor(name, namespace=namespace)
                d = await asyncio.wait_for(actor.describe.remote(), self.config.health.ping_timeout_s)
            except Exception as e:  # noqa: BLE001 - gone meanwhile: the pool starts what is missing
                logger.warning("control plane: worker %s does not answer (%s); not adopted", name, e)
                continue
            role = d.worker_id.rsplit("-", 1)[0]
            found.setdefault(role, []).append((actor, d.worker_id, d.slot, d.address))
        for pool in pools:
            if found.get(pool.role):
                pool.adopt(found[pool.role])
                logger.warning("control plane (re)started: adopted %d %s worker(s)", len(found[pool.role]), pool.role)

    def _snapshot(self) -> Membership:
        assert self.worker_set is not None
        members = tuple(self.worker_set.members())
        fingerprint = tuple((m.worker_id, m.phase, m.healthy) for m in members)
        if fingerprint != self._fingerprint:
            self._fingerprint = fingerprint
            self._version += 1
        # A frontend heartbeats every `ControlPlaneLink.wait_s` at most; one silent for three
        # leases is gone (a busy frontend on a loaded host may miss a beat or two).
        silent_s = 3 * self.config.worker.frontend_lease_s
        now = time.monotonic()
        frontends = tuple(f for f, seen in self._frontends.values() if now - seen <= silent_s)
        workers = tuple(dataclasses.replace(w, load=None) for w in self.worker_set.workers(gone=False))
        return Membership(self.incarnation, self._version, members, workers, frontends)

    async def membership(self, known: tuple[str, int], wait_s: float, frontend: FrontendInfo | None = None,
                         samples: tuple[Sample, ...] = ()) -> Membership:
        """The membership once it differs from `known` (incarnation, version), or after `wait_s`;
        `frontend`: the caller's heartbeat (its registry entry), `samples` its request metrics."""
        await self.start()
        if frontend is not None:
            self._frontends[frontend.frontend_id] = (frontend, time.monotonic())
            self.cluster_metrics.report(frontend.frontend_id, samples)
        deadline = time.monotonic() + wait_s
        while True:
            m = self._snapshot()
            if (m.incarnation, m.version) != tuple(known) or time.monotonic() >= deadline:
                return m
            await asyncio.sleep(POLL_STEP_S)

    async def new_frontend_id(self) -> str:
        """An id for a frontend that joins (`pdserve frontend --join`): never one in use."""
        return f"j{uuid.uuid4().hex[:8]}"

    async def serve_config(self) -> ServeConfig:
        return self.config

    async def report_lost(self, worker_id: str) -> None:
        """A frontend found a worker lost: look now (a dead one is replaced, `Pool.check`)."""
        await self.start()
        logger.warning("control plane: a frontend reports worker %s lost; checking the workers", worker_id)
        assert self.worker_set is not None
        await self.worker_set.check()

    async def admin(self, method: str, *args: Any) -> Any:
        """One of `Elastic`'s changes (the admin API, forwarded by a frontend)."""
        await self.start()
        if method not in ADMIN_METHODS:
            raise ValueError(f"admin method must be one of {', '.join(ADMIN_METHODS)}, got {method!r}")
        return await getattr(self.elastic, method)(*args)

    async def metrics_text(self) -> str:
        """Its /metrics as text (the cluster view among them), for a caller without its port."""
        from prometheus_client import generate_latest

        return generate_latest(self.metrics.registry).decode()

    async def pid(self) -> int:
        import os

        return os.getpid()

    async def stop(self) -> None:
        """Stop the workers (they are detached: nothing else does)."""
        if self._planner is not None:  # first: no change starts while the server stops
            self._planner.cancel()
            await asyncio.gather(self._planner, return_exceptions=True)
        if self.elastic is not None:
            await self.elastic.stop()
        if self.worker_set is not None:
            await self.worker_set.stop()
