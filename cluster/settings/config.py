"""`pdserve serve` configuration: one YAML file (the one Helm renders) plus CLI flags."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pdserve.cluster.settings.pool_config import DrainConfig, PoolConfig
from pdserve.engine import env
from pdserve.engine.config import (
    EngineConfig,
    KVTierConfig,
    ModelConfig,
    SpecConfig,
    WorkerConfig,
)
from pdserve.engine.kv.events import DEVICE_TIER, DISK_TIER, HOST_TIER
from pdserve.engine.loop import LoopConfig
from pdserve.engine.text.tool_parsers import TOOL_FORMATS
from pdserve.kv_transport.config import TransportSettings

SECRET_ENV = env.CLUSTER_SECRET
API_KEY_ENV = env.API_KEY


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The frontends: gRPC and the OpenAI-compatible HTTP API, in one process and event loop.

    host/port: where gRPC clients connect (127.0.0.1 unless configured otherwise; port 0 picks a free one).
    http: serve the OpenAI-compatible HTTP API beside gRPC, on the same host.
    http_port: its port (0 picks a free one).
    metrics_port: Prometheus /metrics on the same host; 0 disables it.
    default_timeout_s: bound on a request without a client deadline.
    shutdown_grace_s: at shutdown, how long gRPC calls and HTTP connections in flight may
        go on before they are cut.
    tls_cert/tls_key: PEM files of the server's certificate (chain) and private key: gRPC and
        the HTTP API then speak TLS only. Both or neither ("" = plaintext, loopback by default).
    tls_client_ca: PEM file of the CA (bundle) whose certificates clients must present (mutual
        TLS): gRPC and the HTTP API refuse, in the TLS handshake, a client without a certificate
        signed by it. Needs tls_cert and tls_key; "" asks clients for no certificate.
    api_key_file: a file holding the bearer token clients must send (gRPC metadata
        `authorization: Bearer <token>`, HTTP header `Authorization: Bearer <token>`; the
        OpenAI clients' api_key). Without it, $PDSERVE_API_KEY; without either, no token is
        asked. The token is never logged. The health checks (gRPC health service, HTTP
        /health) answer without it, for probes.
    admin_token_file: a file holding the admin API's own bearer token (the gRPC `Admin`
        service: list, drain, add and remove workers; `pdserve workers | drain | scale`),
        which must differ from the clients' token; the clients' token is no admin token.
        "" turns the admin API off (its calls are refused, saying how to turn it on). Never
        logged.
    chat_template: a Jinja chat template file used instead of the model's own (e.g. one that
        renders tools, for a model whose template does not); "" keeps the model's.
    tool_call_parser: the model's tool-call format, which chat requests with tool_choice auto
        are parsed in: "hermes" (Qwen, Hermes: <tool_call> JSON) or "llama3_json" (Llama 3.1+);
        "" refuses auto (forced tool choices still work). Both for a template that renders tools.
    tool_format_fallback: what a chat with tools gets when the template renders none (the
        default model's): "generic" (pdserve's generic format, engine/text/generic_tools.py:
        the tools in a system message, the answer constrained to a call or a reply; responses
        say `x-pdserve-tool-format: generic`) or "refuse" (400, naming --chat-template).
    tenants_file: a YAML file mapping API keys to tenants and their weights
        (`cluster/settings/tenants.py`): each tenant's keys are client tokens too, and a full
        server's admission keeps each tenant to its weighted share while another waits. ""
        is one tenant. Never logged.
    frontends: frontend processes serving the APIs over the one set of pools (`docs/architecture.md`,
        "What is shared and who owns it"): frontend i listens on `port + i`, `http_port + i` and
        `metrics_port + i` (0 stays 0: a free port each), the control plane's /metrics on
        `metrics_port + frontends`. 1 (the default): one process serves everything.
    control_plane: run the worker set in a control plane of its own even with one frontend, so that
        more can join (`pdserve frontend --join`); always on with frontends > 1.
    """

    host: str = "127.0.0.1"
    port: int = 50051
    http: bool = True
    http_port: int = 8000
    metrics_port: int = 9400
    default_timeout_s: float = 600.0
    shutdown_grace_s: float = 2.0
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    api_key_file: str = ""
    admin_token_file: str = ""
    chat_template: str = ""
    tool_call_parser: str = ""
    tool_format_fallback: str = "generic"
    tenants_file: str = ""
    frontends: int = 1
    control_plane: bool = False

    @property
    def scaled_out(self) -> bool:
        """Whether the APIs run in frontend processes apart from a control plane."""
        return self.control_plane or self.frontends > 1

    def __post_init__(self) -> None:
        if self.frontends < 1:
            raise ValueError(f"ServerConfig.frontends must be >= 1, got {self.frontends}")
        if self.tool_format_fallback not in ("generic", "refuse"):
            raise ValueError(f"ServerConfig.tool_format_fallback must be generic or refuse, "
                             f"got {self.tool_format_fallback!r}")
        if self.tool_call_parser and self.tool_call_parser not in TOOL_FORMATS:
            raise ValueError(f"ServerConfig.tool_call_parser must be one of {sorted(TOOL_FORMATS)} or \"\", "
                             f"got {self.tool_call_parser!r}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("ServerConfig.tls_cert and tls_key go together: give both or neither")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("ServerConfig.tls_client_ca (client certificates, mutual TLS) needs the server's "
                             "own TLS: set tls_cert and tls_key too")
        ports = (self.port, self.http_port, self.metrics_port)
        if not all(0 <= p <= 65535 for p in ports):
            raise ValueError(f"ServerConfig ports must be in [0, 65535], got port={self.port}, "
                             f"http_port={self.http_port}, metrics_port={self.metrics_port}")
        if self.default_timeout_s <= 0:
            raise ValueError(f"ServerConfig.default_timeout_s must be > 0, got {self.default_timeout_s}")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"ServerConfig.shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """How many requests the server takes at once: for each healthy decode worker, its
    running seats (`engine.scheduler.max_num_seqs`) plus `max_waiting_per_worker` requests
    queued for a seat. A disaggregated request runs once a decode worker has a seat and the
    free KV blocks for its prompt; until then it waits in the queue, whose length is
    bounded by `max_waiting_per_worker` x the healthy decode workers. Beyond either bound a
    request is refused at once with RESOURCE_EXHAUSTED and a retry hint.

    max_waiting_per_worker: requests queued per decode worker beyond its running seats.
    retry_after_s: the retry hint of a refused request (the `grpc-retry-pushback-ms` trailer).
    """

    max_waiting_per_worker: int = 128
    retry_after_s: float = 1.0

    def __post_init__(self) -> None:
        if self.max_waiting_per_worker < 0:
            raise ValueError(f"AdmissionConfig.max_waiting_per_worker must be >= 0, got {self.max_waiting_per_worker}")
        if self.retry_after_s <= 0:
            raise ValueError(f"AdmissionConfig.retry_after_s must be > 0, got {self.retry_after_s}")


@dataclass(frozen=True, slots=True)
class CoordinatorConfig:
    """The coordinator's own waits and refreshes.

    poll_wait_s: how long one long-poll of a decode worker's token deltas waits for one.
    load_refresh_s: how often every worker's load (for routing and metrics) is read.
    seat_recheck_s: a request waiting for a decode seat looks again this often, besides
        being woken when one frees (a replaced worker's seats are found this way).
    abort_timeout_s: bound on aborting a request on a worker.
    max_migrations: how often one request may continue on another worker after losing
        one (its prompt plus the tokens streamed so far prefilled again); 0 fails it with
        UNAVAILABLE at once, as before.
    migration_wait_s: a request that finds no healthy worker of a role waits up to this
        long for a lost one's replacement, before UNAVAILABLE: a continued request always,
        a new one while a replacement is under way (with none, it is refused at once).
    reserve_retries: how often a request whose decode reservation the worker refused (its
        blocks of a request that just ended not freed yet, though the coordinator's budget
        counts them free) takes its seat again, `load_refresh_s` later, before
        RESOURCE_EXHAUSTED.
    """

    poll_wait_s: float = 0.5
    load_refresh_s: float = 0.25
    seat_recheck_s: float = 1.0
    abort_timeout_s: float = 10.0
    max_migrations: int = 3
    migration_wait_s: float = 120.0
    reserve_retries: int = 8

    def __post_init__(self) -> None:
        counts = ("max_migrations", "reserve_retries")
        for f in dataclasses.fields(self):
            if f.name not in counts and getattr(self, f.name) <= 0:
                raise ValueError(f"CoordinatorConfig.{f.name} must be > 0, got {getattr(self, f.name)}")
        for name in counts:
            if getattr(self, name) < 0:
                raise ValueError(f"CoordinatorConfig.{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """How the router weighs a worker. Its load score (lower wins) is its requests in flight
    + `kv_usage_weight` x the used fraction of its KV blocks + its queued prefill tokens /
    `queued_tokens_per_request`. Prefix-aware routing (`pools.routing`) adds, for a request,
    `prompt_weight` x the prompt tokens the worker would still compute (the prompt less the
    leading blocks the KV index says it holds) / `queued_tokens_per_request`, and takes the
    cheapest worker (Dynamo's KV router: overlap-weighted prefill work plus load).

    kv_usage_weight: what a worker's fully used KV pool adds to its score.
    queued_tokens_per_request: prompt tokens (queued, or a request's new ones) that weigh as
        much as one request.
    prompt_weight: how much a request's own prompt work weighs against the worker's load
        (Dynamo's kv-overlap-score-weight): 0 routes by load alone, higher values follow
        cached prefixes onto busier workers.
    host_tier_credit, disk_tier_credit: what a prompt block a worker holds in its host-memory
        or disk tier (`engine/kv/tiers.py`) saves, as a fraction of one in its device pool
        (1): it is copied back before the step, which costs less than computing it but not
        nothing.
    """

    kv_usage_weight: float = 4.0
    queued_tokens_per_request: float = 4096.0
    prompt_weight: float = 1.0
    host_tier_credit: float = 0.8
    disk_tier_credit: float = 0.5

    @property
    def tier_credits(self) -> dict[str, float]:
        """Each KV tier's credit for a prompt block held there."""
        return {DEVICE_TIER: 1.0, HOST_TIER: self.host_tier_credit, DISK_TIER: self.disk_tier_credit}

    def __post_init__(self) -> None:
        if self.kv_usage_weight < 0 or self.prompt_weight < 0:
            raise ValueError(f"RouterConfig weights must be >= 0, got kv_usage_weight={self.kv_usage_weight}, "
                             f"prompt_weight={self.prompt_weight}")
        if self.queued_tokens_per_request <= 0:
            raise ValueError(f"RouterConfig.queued_tokens_per_request must be > 0, "
                             f"got {self.queued_tokens_per_request}")
        for name in ("host_tier_credit", "disk_tier_credit"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"RouterConfig.{name} must be in [0, 1], got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class HealthConfig:
    """How workers are found dead or stuck, and replaced. Busy is not dead: a ping is
    answered on the worker's own health thread, never behind an engine step.

    interval_s: how often every worker is pinged.
    ping_timeout_s: bound on one ping. A missed ping alone replaces nothing.
    unresponsive_after_s: a worker that answered no ping for this long is replaced
        (its process is wedged). A worker whose process died is replaced at once.
    stuck_after_s: a worker whose engine loop has not turned for this long (one step or
        command running all that time) is replaced. Generous: on a CPU one prefill step
        of a long prompt takes minutes.
    start_timeout_s: bound on a worker's start (model load and a first GGUF conversion).
    start_report_s: a worker not started yet says so this often, and why: waiting for room (what
        it needs, what the cluster has) or loading its model.
    start_attempts: how often a worker is created before its pool gives up, when Ray reports
        the actor dead before its constructor ran (a failed constructor is not retried).
    """

    interval_s: float = 2.0
    ping_timeout_s: float = 5.0
    unresponsive_after_s: float = 60.0
    stuck_after_s: float = 1800.0
    start_timeout_s: float = 300.0
    start_report_s: float = 5.0
    start_attempts: int = 2

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) <= 0:
                raise ValueError(f"HealthConfig.{f.name} must be > 0, got {getattr(self, f.name)}")


@dataclass(frozen=True, slots=True)
class RayConfig:
    """The Ray cluster the pools run on.

    address: None starts a local Ray cluster; "auto" or host:port joins one.
    node_ip_address: the address this node is known by in Ray (127.0.0.1: a local
        cluster on loopback only; a pod's IP in Kubernetes).
    namespace: the Ray namespace a scaled-out server's control plane, frontends and workers are
        named in (`pdserve frontend --join ADDRESS --namespace NS` finds them there); one per
        server sharing a Ray cluster.
    """

    address: str | None = None
    node_ip_address: str = "127.0.0.1"
    namespace: str = "pdserve"

    def __post_init__(self) -> None:
        if not self.node_ip_address:
            raise ValueError("RayConfig.node_ip_address must not be empty")


@dataclass(frozen=True, slots=True)
class ServeConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    pools: PoolConfig = field(default_factory=PoolConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    kv_transport: TransportSettings = field(default_factory=TransportSettings)
    health: HealthConfig = field(default_factory=HealthConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    coordinator: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    drain: DrainConfig = field(default_factory=DrainConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)

    def __post_init__(self) -> None:
        # A frontend's polls and load reads renew its lease: each must come well inside it.
        waits = self.coordinator  # the CoordinatorConfig (a name the ownership test reads as the coordinator's)
        longest = max(waits.poll_wait_s, waits.load_refresh_s)
        if not self.worker.frontend_lease_s > 2 * longest:
            raise ValueError(f"worker.frontend_lease_s ({self.worker.frontend_lease_s:g} s) must exceed twice "
                             f"coordinator.poll_wait_s and load_refresh_s ({longest:g} s): live frontends would "
                             "lose their requests")

    def engine_for(self, role: str) -> EngineConfig:
        """The engine config of the workers of `role`: the pool's tensor-parallel size; a prefill
        worker's without speculation (it computes prompts and their first token: nothing to draft),
        but built with the model's MTP layer when the decode workers draft with it (method "mtp"
        at K 0: the prompt's MTP KV is computed where the prompt is, and sent with the rest)."""
        size = self.pools.tp(role, self.engine)
        spec = self.engine.spec
        if role == "prefill":
            spec = SpecConfig(method="mtp", num_speculative_tokens=0) if spec.method == "mtp" else SpecConfig()
        return dataclasses.replace(self.engine, spec=spec, parallel=dataclasses.replace(self.engine.parallel,
                                                                                         tensor_parallel_size=size))


def _sections(cls: type) -> dict[str, type]:
    """A config's sections (its fields, each a config dataclass) by name, from the class itself."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


_SECTIONS = {name: cls for name, cls in _sections(ServeConfig).items() if name != "engine"}
_ENGINE_SECTIONS = _sections(EngineConfig)


def _build(cls: type, values: dict[str, Any], where: str) -> Any:
    if not isinstance(values, dict):
        raise ValueError(f"config section {where!r} must be a mapping, got {type(values).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - names
    if unknown:
        raise ValueError(f"unknown keys in config section {where!r}: {sorted(unknown)}")
    # A YAML "no" quoted, or "false" from a --set flag, would be a truthy string: refuse it.
    for f in dataclasses.fields(cls):
        if f.type in ("bool", bool) and f.name in values and not isinstance(values[f.name], bool):
            raise ValueError(f"config section {where!r}: {f.name} must be true or false, got {values[f.name]!r}")
    hints = typing.get_type_hints(cls)
    values = {k: _build(hints[k], v or {}, f"{where}.{k}") if dataclasses.is_dataclass(hints[k]) else v
              for k, v in values.items()}  # a section inside a section (pools.planner)
    if cls is ModelConfig and "cache_dir" in values:
        values = {**values, "cache_dir": Path(values["cache_dir"])}
    if cls is KVTierConfig and values.get("disk_dir"):
        values = {**values, "disk_dir": Path(values["disk_dir"])}
    try:
        return cls(**values)
    except TypeError as e:
        raise ValueError(f"config section {where!r}: {e}") from e


def config_from_dict(data: dict[str, Any]) -> ServeConfig:
    """Build a ServeConfig from the YAML structure; unknown keys and bad values are ValueErrors."""
    data = data or {}
    unknown = set(data) - set(_SECTIONS) - {"engine"}
    if unknown:
        raise ValueError(f"unknown config sections: {sorted(unknown)}")
    engine = data.get("engine") or {}
    bad = set(engine) - set(_ENGINE_SECTIONS)
    if bad:
        raise ValueError(f"unknown keys in config section 'engine': {sorted(bad)}")
    engine_config = EngineConfig(**{k: _build(c, engine.get(k) or {}, f"engine.{k}")
                                    for k, c in _ENGINE_SECTIONS.items()})
    sections = {k: _build(c, data.get(k) or {}, k) for k, c in _SECTIONS.items()}
    return ServeConfig(engine=engine_config, **sections)


def load_config(path: str | Path) -> ServeConfig:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError as e:
        raise ValueError(f"config file {str(path)!r} does not exist") from e
    except yaml.YAMLError as e:
        raise ValueError(f"config file {str(path)!r} is not valid YAML: {e}") from e
    return config_from_dict(data)
