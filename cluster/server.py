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
from pdserve.cluster.settings.secrets import client_auth, cluster_secret, read_chat_template
from pdserve.cluster.settings.tenants import Tenants
from pdserve.cluster.sim.step_costs import StepCosts
from pdserve.decode_node.worker import DecodeWorker
from pdserve.engine.models.parallel import check_splits
from pdserve.engine.models.weights import load_tokenizer, resolve_model
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


def _pools(config: ServeConfig, transport: TransportConfig | None) -> tuple[Pool | None, Pool]:
    num_gpus = ray.cluster_resources().get("GPU", 0)
    p = fit_pools_to_gpus(config.pools, num_gpus, config.engine)
    if p.mode != config.pools.mode:
        logger.warning("%g GPU(s) cannot hold %d prefill + %d decode workers: serving colocated, "
                       "one mixed worker per %d GPU(s)", num_gpus, config.pools.num_prefill, config.pools.num_decode,
                       p.tp("decode", config.engine))
    config = dataclasses.replace(config, pools=p)
    health, waits = config.health, (config.worker, config.loop)

    def spec(cls: type, role: str, with_transport: bool) -> ActorSpec:
        # A worker of tensor-parallel size N holds N GPUs of one node (one Ray actor: its
        # other ranks are processes it starts); on the CPU its ranks share the actor's CPU.
        gpus = p.gpus_per_worker * p.tp(role, config.engine)
        resource = p.prefill_resource if role == "prefill" else p.decode_resource
        return ActorSpec(cls, (config.engine_for(role), transport if with_transport else None, *waits), 1,
                         gpus, resource, p.actor_max_concurrency)

    if p.mode == "colocated":
        return None, Pool("mixed", p.num_decode, spec(DecodeWorker, "decode", False), health)
    return (Pool("prefill", p.num_prefill, spec(PrefillWorker, "prefill", True), health),
            Pool("decode", p.num_decode, spec(DecodeWorker, "decode", True), health))


async def start_server(config: ServeConfig) -> Server:
    auth = client_auth(config.server)  # bad paths fail before anything starts
    tenants = Tenants.load(config.server.tenants_file)
    if auth.admin_token is not None and auth.admin_token in tenants.keys:
        raise ValueError("the admin token (server.admin_token_file) must differ from every tenant's key "
                         "(server.tenants_file): a client could run the admin API")
    # The clients' tokens: the API key and every tenant's keys (None: no token asked).
    client_tokens = (*((auth.api_key,) if auth.api_key else ()), *tenants.keys) or None
    chat_template = read_chat_template(config.server)
    files = resolve_model(config.engine.model)  # converts a GGUF once, before the workers need it
    for role in ("decode",) if config.pools.mode == "colocated" else ("prefill", "decode"):
        check_splits(files.arch, config.pools.tp(role, config.engine),  # before any worker starts
                     config.engine.parallel.enable_expert_parallel)
    planner = _planner(config)  # a bad profile fails before any worker starts
    init_ray(config.ray.address, config.ray.node_ip_address)
    tokenizer = load_tokenizer(files)  # None for dummy weights: token ids in and out, no text
    if chat_template is not None:
        if tokenizer is None:
            raise ValueError(f"server.chat_template: model {files.name!r} has no tokenizer to apply it with")
        tokenizer.chat_template = chat_template  # the frontend's copy: workers never apply templates
    transport = None
    if config.pools.mode == "disaggregated":
        transport = TransportConfig.of(config.kv_transport, cluster_secret(), config.ray.node_ip_address)
    prefill, decode = _pools(config, transport)
    metrics = Metrics()
    worker_set = WorkerSet(prefill, decode, config.pools.routing, config.engine.cache.block_size, metrics,
                           config.engine.scheduler.max_num_seqs, config.admission.max_waiting_per_worker,
                           config.coordinator, config.router, config.engine.scheduler.policy == "priority")
    await worker_set.start(config.health.interval_s)
    coordinator = Coordinator(worker_set, config.engine.cache.block_size, metrics, config.coordinator)
    processor = RequestProcessor(tokenizer, files.name, files.arch.vocab_size, await worker_set.max_model_len(),
                                 tool_format(config.server.tool_call_parser),
                                 config.server.tool_format_fallback == "generic")

    frontend = Frontend(coordinator, worker_set, processor, metrics, config.server.default_timeout_s,
                        config.admission.retry_after_s, tenants)
    # The tokens are checked before a request is parsed; a request that does not parse is
    # INVALID_ARGUMENT. The admin service answers to its own token only (AdminTokenInterceptor).
    interceptors = [AdminTokenInterceptor(auth.admin_token, client_tokens)]
    interceptors += [BearerTokenInterceptor(client_tokens)] if client_tokens else []
    server = grpc.aio.server(interceptors=[*interceptors, MalformedRequestInterceptor()])
    service = GenerationService(frontend)
    generation_pb2_grpc.add_GenerationServicer_to_server(service, server)
    elastic = Elastic(worker_set, config.drain)
    admin_pb2_grpc.add_AdminServicer_to_server(AdminService(elastic), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, ADMIN_SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{config.server.host}:{config.server.port}"
    if auth.tls:
        port = server.add_secure_port(address, grpc_server_credentials(auth))
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise ValueError(f"cannot bind {config.server.host}:{config.server.port}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    http = None
    if config.server.http:
        http = HttpServer(frontend, HttpTls.of(config.server), client_tokens, config.server.shutdown_grace_s)
        try:
            await http.start(config.server.host, config.server.http_port)
        except BaseException:
            await server.stop(None)
            await worker_set.stop()
            raise
    if config.server.metrics_port:
        metrics.serve(config.server.host, config.server.metrics_port)
    tls = ("on, client certificates required" if auth.mutual_tls else "on") if auth.tls else "off"
    logger.info("pdserve serving %s on %s:%d, HTTP %s (%s, %s; TLS %s, bearer token %s, admin API %s)", files.name,
                config.server.host, port, http.port if http else "off", coordinator.mode,
                "GPU" if torch.cuda.is_available() else "CPU", tls,
                "asked" if client_tokens else "not asked", "on" if auth.admin_token else "off")
    loop = None
    if planner is not None and coordinator.mode == "disaggregated":
        loop = asyncio.create_task(PlannerLoop(planner, config.pools.planner, worker_set, elastic, metrics).run())
    elif planner is not None:
        logger.warning("pools.planner: this server is %s (too few GPUs for both pools): the planner stays off",
                       coordinator.mode)
    return Server(server, coordinator, worker_set, elastic, health_servicer, metrics, port, frontend, http,
                  config.server.shutdown_grace_s, loop)


def _planner(config: ServeConfig) -> Planner | None:
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
    await server.stop()
    ray.shutdown()
