"""`pdserve serve`: Ray pools, the coordinator, the gRPC server, the OpenAI HTTP API and /metrics,
in one process and one event loop."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
from dataclasses import dataclass

import grpc
import ray
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.cluster.api.admin_service import AdminService
from pdserve.cluster.api.auth import HttpTls, grpc_server_credentials
from pdserve.cluster.api.frontend import Frontend
from pdserve.cluster.api.grpc_service import GenerationService
from pdserve.cluster.api.http_api import HttpServer
from pdserve.cluster.api.interceptors import AdminTokenInterceptor, BearerTokenInterceptor, MalformedRequestInterceptor
from pdserve.cluster.ray_driver import init_ray
from pdserve.cluster.scaling.elastic import Elastic
from pdserve.cluster.scaling.planner import Planner
from pdserve.cluster.scaling.planner_loop import PlannerLoop
from pdserve.cluster.serving.coordinator import Coordinator
from pdserve.cluster.serving.metrics import Metrics
from pdserve.cluster.serving.pools import ActorSpec, Pool
from pdserve.cluster.serving.worker_set import WorkerSet
from pdserve.cluster.settings.config import ServeConfig
from pdserve.cluster.settings.pool_config import fit_pools_to_gpus
from pdserve.cluster.settings.secrets import ClientAuth, client_auth, cluster_secret, read_chat_template
from pdserve.cluster.settings.tenants import Tenants
from pdserve.cluster.sim.step_costs import StepCosts
from pdserve.decode_node.worker import DecodeWorker
from pdserve.engine.models.parallel import check_splits
from pdserve.engine.models.weights import ModelFiles, load_tokenizer, resolve_model
from pdserve.engine.text.request_processor import RequestProcessor
from pdserve.engine.text.tools import tool_format
from pdserve.kv_transport import TransportConfig
from pdserve.prefill_node.worker import PrefillWorker
from pdserve.proto.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
ADMIN_SERVICE_NAME = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name


@dataclass(slots=True)
class Server:
    """A running server; `stop()` takes everything down."""

    grpc_server: grpc.aio.Server
    coordinator: Coordinator
    worker_set: WorkerSet
    elastic: Elastic
    health: health.aio.HealthServicer
    metrics: Metrics
    port: int
    frontend: Frontend
    http: HttpServer | None = None
    shutdown_grace_s: float = 2.0
    planner: asyncio.Task[None] | None = None  # the planner's loop (`pools.planner.enabled`)

    @property
    def http_port(self) -> int | None:
        return None if self.http is None else self.http.port

    async def stop(self) -> None:
        if self.planner is not None:  # first: no change starts while the server stops
            self.planner.cancel()
            await asyncio.gather(self.planner, return_exceptions=True)
        if self.http is not None:
            await self.http.stop()
        await self.grpc_server.stop(grace=self.shutdown_grace_s)
        await self.elastic.stop()
        await self.worker_set.stop()


def _pools(config: ServeConfig, transport: TransportConfig | None,
           namespace: str | None = None) -> tuple[Pool | None, Pool]:
    num_gpus = ray.cluster_resources().get("GPU", 0)
    p = fit_pools_to_gpus(config.pools, num_gpus, config.engine)
    if p.mode != config.pools.mode:
        logger.warning("%g GPU(s) cannot hold %d prefill + %d decode workers: serving colocated, "
                       "one mixed worker per %d GPU(s)", num_gpus, config.pools.num_prefill, config.pools.num_decode,
                       p.tp("decode", config.engine))
    config = dataclasses.replace(config, pools=p)
    worker = config.worker if config.worker.max_queued else \
        dataclasses.replace(config.worker, max_queued=config.admission.max_waiting_per_worker)
    health, waits = config.health, (worker, config.loop)

    def spec(cls: type, role: str, with_transport: bool) -> ActorSpec:
        # A worker of tensor-parallel size N holds N GPUs of one node (one Ray actor: its
        # other ranks are processes it starts); on the CPU its ranks share the actor's CPU.
        gpus = p.gpus_per_worker * p.tp(role, config.engine)
        resource = p.prefill_resource if role == "prefill" else p.decode_resource
        return ActorSpec(cls, (config.engine_for(role), transport if with_transport else None, *waits), 1,
                         gpus, resource, p.actor_max_concurrency)

    if p.mode == "colocated":
        return None, Pool("mixed", p.num_decode, spec(DecodeWorker, "decode", False), health, namespace)
    return (Pool("prefill", p.num_prefill, spec(PrefillWorker, "prefill", True), health, namespace),
            Pool("decode", p.num_decode, spec(DecodeWorker, "decode", True), health, namespace))


@dataclass(frozen=True, slots=True)
class ApiSetup:
    """What a process serving the APIs reads before it serves: the clients' and admin tokens, the
    tenants, the model's files and tokenizer (every frontend process reads them itself)."""

    auth: ClientAuth
    tenants: Tenants
    client_tokens: tuple[str, ...] | None  # the API key and every tenant's keys (None: no token asked)
    files: ModelFiles
    chat_template: str | None

    @classmethod
    def read(cls, config: ServeConfig) -> ApiSetup:
        auth = client_auth(config.server)  # bad paths fail before anything starts
        tenants = Tenants.load(config.server.tenants_file)
        if auth.admin_token is not None and auth.admin_token in tenants.keys:
            raise ValueError("the admin token (server.admin_token_file) must differ from every tenant's key "
                             "(server.tenants_file): a client could run the admin API")
        client_tokens = (*((auth.api_key,) if auth.api_key else ()), *tenants.keys) or None
        files = resolve_model(config.engine.model)  # converts a GGUF once, before the workers need it
        return cls(auth, tenants, client_tokens, files, read_chat_template(config.server))

    def processor(self, config: ServeConfig, max_model_len: int) -> RequestProcessor:
        tokenizer = load_tokenizer(self.files)  # None for dummy weights: token ids in and out, no text
        if self.chat_template is not None:
            if tokenizer is None:
                raise ValueError(f"server.chat_template: model {self.files.name!r} has no tokenizer to apply it with")
            tokenizer.chat_template = self.chat_template  # the frontend's copy: workers never apply templates
        return RequestProcessor(tokenizer, self.files.name, self.files.arch.vocab_size, max_model_len,
                                tool_format(config.server.tool_call_parser),
                                config.server.tool_format_fallback == "generic")


@dataclass(slots=True)
class Apis:
    """One process's doors: gRPC (Generation, Admin, health, reflection) and the HTTP API."""

    grpc_server: grpc.aio.Server
    health: health.aio.HealthServicer
    port: int
    http: HttpServer | None

    async def stop(self, grace_s: float) -> None:
        if self.http is not None:
            await self.http.stop()
        await self.grpc_server.stop(grace=grace_s)


async def open_apis(config: ServeConfig, setup: ApiSetup, frontend: Frontend, admin: AdminService, port: int,
                    http_port: int) -> Apis:
    """gRPC on `port` and (`server.http`) the HTTP API on `http_port`, both serving `frontend`."""
    auth, client_tokens = setup.auth, setup.client_tokens
    # The tokens are checked before a request is parsed; a request that does not parse is
    # INVALID_ARGUMENT. The admin service answers to its own token only (AdminTokenInterceptor).
    interceptors = [AdminTokenInterceptor(auth.admin_token, client_tokens)]
    interceptors += [BearerTokenInterceptor(client_tokens)] if client_tokens else []
    server = grpc.aio.server(interceptors=[*interceptors, MalformedRequestInterceptor()])
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationService(frontend), server)
    admin_pb2_grpc.add_AdminServicer_to_server(admin, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, ADMIN_SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{config.server.host}:{port}"
    bound = server.add_secure_port(address, grpc_server_credentials(auth)) if auth.tls \
        else server.add_insecure_port(address)
    if bound == 0:
        raise ValueError(f"cannot bind {address}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    http = None
    if config.server.http:
        http = HttpServer(frontend, HttpTls.of(config.server), client_tokens, config.server.shutdown_grace_s)
        try:
            await http.start(config.server.host, http_port)
        except BaseException:
            await server.stop(None)
            raise
    return Apis(server, health_servicer, bound, http)


def log_serving(config: ServeConfig, setup: ApiSetup, apis: Apis, mode: str, what: str = "pdserve") -> None:
    auth = setup.auth
    tls = ("on, client certificates required" if auth.mutual_tls else "on") if auth.tls else "off"
    logger.info("%s serving %s on %s:%d, HTTP %s (%s, %s; TLS %s, bearer token %s, admin API %s)", what,
                setup.files.name, config.server.host, apis.port, apis.http.port if apis.http else "off", mode,
                "GPU" if torch.cuda.is_available() else "CPU", tls,
                "asked" if setup.client_tokens else "not asked", "on" if auth.admin_token else "off")


def check_splits_of(config: ServeConfig, setup: ApiSetup) -> None:
    for role in ("decode",) if config.pools.mode == "colocated" else ("prefill", "decode"):
        check_splits(setup.files.arch, config.pools.tp(role, config.engine),  # before any worker starts
                     config.engine.parallel.enable_expert_parallel)


def build_pools(config: ServeConfig, namespace: str | None = None, secret: bytes | None = None
                ) -> tuple[Pool | None, Pool]:
    """The pools of `config` (not started); `namespace`: a control plane's (detached, named workers);
    `secret`: the workers' cluster secret (None: `cluster_secret()`)."""
    transport = None
    if config.pools.mode == "disaggregated":
        transport = TransportConfig.of(config.kv_transport, secret or cluster_secret(), config.ray.node_ip_address)
    return _pools(config, transport, namespace)


async def start_server(config: ServeConfig) -> Server:
    setup = ApiSetup.read(config)
    check_splits_of(config, setup)
    planner = build_planner(config)  # a bad profile fails before any worker starts
    init_ray(config.ray.address, config.ray.node_ip_address)
    prefill, decode = build_pools(config)
    metrics = Metrics()
    worker_set = WorkerSet(prefill, decode, config.pools.routing, config.engine.cache.block_size, metrics,
                           config.engine.scheduler.max_num_seqs, config.admission.max_waiting_per_worker,
                           config.coordinator, config.router,
                           preempt_seats=config.engine.scheduler.policy == "priority")
    await worker_set.start(config.health.interval_s)
    coordinator = Coordinator(worker_set, config.engine.cache.block_size, metrics, config.coordinator)
    processor = setup.processor(config, await worker_set.max_model_len())
    frontend = Frontend(coordinator, worker_set, processor, metrics, config.server.default_timeout_s,
                        config.admission.retry_after_s, setup.tenants)
    elastic = Elastic(worker_set, config.drain)
    try:
        apis = await open_apis(config, setup, frontend, AdminService(elastic), config.server.port,
                               config.server.http_port)
    except BaseException:
        await worker_set.stop()
        raise
    if config.server.metrics_port:
        metrics.serve(config.server.host, config.server.metrics_port)
    log_serving(config, setup, apis, coordinator.mode)
    loop = None
    if planner is not None and coordinator.mode == "disaggregated":
        loop = asyncio.create_task(PlannerLoop(planner, config.pools.planner, worker_set, elastic, metrics).run())
    elif planner is not None:
        logger.warning("pools.planner: this server is %s (too few GPUs for both pools): the planner stays off",
                       coordinator.mode)
    return Server(apis.grpc_server, coordinator, worker_set, elastic, apis.health, metrics, apis.port, frontend,
                  apis.http, config.server.shutdown_grace_s, loop)


def build_planner(config: ServeConfig) -> Planner | None:
    """The planner when `pools.planner` is on: its budget is `max_workers`, else the pools' size."""
    c = config.pools.planner
    if not c.enabled:
        return None
    budget = c.max_workers or config.pools.num_prefill + config.pools.num_decode
    logger.info("planner on%s: TTFT %g ms, ITL %g ms at p%d, %d workers at most, every %g s",
                " (dry run)" if c.dry_run else "", c.ttft_target_ms, c.itl_target_ms, c.percentile, budget,
                c.interval_s)
    return Planner(c, StepCosts.load(c.profile), budget)


async def serve_forever(config: ServeConfig) -> None:
    server = await start_server(config)
    scheme = "https" if config.server.tls_cert else "http"
    http = f", OpenAI HTTP API on {scheme}://{config.server.host}:{server.http_port}/v1" if server.http else ""
    print(f"pdserve: serving gRPC on {config.server.host}:{server.port}{http} ({server.coordinator.mode}); "
          "Ctrl-C stops", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop()  # Ray ends with the command (cli: ray_driver.ray_ending_with)
