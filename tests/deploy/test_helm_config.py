"""What the chart renders means what it should: the ConfigMap is the config
`pdserve serve` builds, the worker groups offer the resources the pools place
by, the frontend is reachable through the Service and only it is exposed."""

from __future__ import annotations

import copy
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.cluster.settings.config import RayConfig, ServeConfig, ServerConfig
from pdserve.cluster.settings.pool_config import PoolConfig
from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.kv_transport.config import TransportSettings
from tests.deploy.conftest import GPU_VALUES, Render, one, run_helm, template_args

POD_IP = "10.1.2.3"
RAY_PORTS = {6379, 8265, 10001, 52365, 8076}  # GCS, dashboard, client, dashboard agent, object manager

EXPECTED = {
    "default": ServeConfig(
        engine=EngineConfig(model=ModelConfig(source="default", cache_dir=Path("/var/cache/pdserve"))),
        server=ServerConfig(host="0.0.0.0", port=50051, http=True, http_port=8000, metrics_port=9400),
        pools=PoolConfig(mode="disaggregated", num_prefill=1, num_decode=1, gpus_per_worker=0.0,
                         prefill_resource="prefill", decode_resource="decode", routing="prefix_aware"),
        ray=RayConfig(address="auto", node_ip_address=POD_IP),
        kv_transport=TransportSettings(),
    ),
    "gpu-2node": ServeConfig(
        engine=EngineConfig(
            model=ModelConfig(source="/models/Qwen2.5-7B-Instruct", dtype="bfloat16", device="cuda",
                              max_model_len=32768, cache_dir=Path("/var/cache/pdserve")),
            cache=CacheConfig(gpu_memory_utilization=0.9),
            scheduler=SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=256),
        ),
        server=ServerConfig(host="0.0.0.0", port=50051, http=True, http_port=8000, metrics_port=9400),
        pools=PoolConfig(mode="disaggregated", num_prefill=8, num_decode=8, gpus_per_worker=1.0,
                         prefill_resource="prefill", decode_resource="decode"),
        ray=RayConfig(address="auto", node_ip_address=POD_IP),
        kv_transport=TransportSettings(allowed_transports=("cuda_ipc", "rdma", "tcp")),
    ),
}
VALUES = {"default": (), "gpu-2node": (GPU_VALUES,)}


def head_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]


def worker_groups(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {g["groupName"]: g for g in one(docs, "RayCluster")["spec"]["workerGroupSpecs"]}


def served_config(docs: list[dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ServeConfig:
    """The ServeConfig `pdserve serve` builds on the head from the rendered ConfigMap and command."""
    import uvloop

    from pdserve.cluster import server
    from pdserve.cluster.cli import main

    script = head_container(docs)["args"][0]
    # The head substitutes its pod IP into the ConfigMap's file, as its script does with sed.
    assert 'sed "s/__POD_IP__/${POD_IP}/" /etc/pdserve-template/config.yaml > /etc/pdserve/config.yaml' in script
    text = one(docs, "ConfigMap")["data"]["config.yaml"].replace("__POD_IP__", POD_IP)
    (tmp_path / "config.yaml").write_text(text)
    exec_line = [line for line in script.splitlines() if line.startswith("exec pdserve serve")]
    assert len(exec_line) == 1, script
    argv = shlex.split(exec_line[0])[2:]
    argv[argv.index("--config") + 1] = str(tmp_path / "config.yaml")

    built: list[ServeConfig] = []
    monkeypatch.setattr(server, "serve_forever", lambda config: config)
    monkeypatch.setattr(uvloop, "run", built.append)
    assert argv[0] == "serve" and main(argv) == 0
    return built[0]


@pytest.mark.parametrize("values", list(VALUES), ids=list(VALUES))
def test_configmap_is_the_config_pdserve_serve_builds(render: Render, values: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render(VALUES[values])
    assert served_config(docs, tmp_path, monkeypatch) == EXPECTED[values]


def test_configmap_parses_with_the_loader(render: Render, tmp_path: Path) -> None:
    from pdserve.cluster.settings.config import config_from_dict, load_config

    text = one(render(), "ConfigMap")["data"]["config.yaml"].replace("__POD_IP__", POD_IP)
    (tmp_path / "c.yaml").write_text(text)
    assert load_config(tmp_path / "c.yaml") == config_from_dict(yaml.safe_load(text)) == EXPECTED["default"]


def test_colocated_mode_has_no_prefill_group(render: Render, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render(sets=("config.pools.mode=colocated", "decode.replicas=2"))
    assert list(worker_groups(docs)) == ["decode"]
    pools = served_config(docs, tmp_path, monkeypatch).pools
    assert (pools.mode, pools.num_prefill, pools.num_decode) == ("colocated", 0, 2)


def test_router_weights_and_the_kv_event_bound_reach_the_config(render: Render, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render(sets=("config.router.prompt_weight=2", "config.engine.cache.kv_events_max_pending=1024"))
    config = served_config(docs, tmp_path, monkeypatch)
    assert config.router.prompt_weight == 2 and config.engine.cache.kv_events_max_pending == 1024


def test_tensor_parallel_workers_take_all_their_gpus(render: Render, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render(sets=("config.pools.mode=colocated", "config.engine.parallel.tensor_parallel_size=2",
                        "decode.gpus=4", "decode.workersPerPod=2"))
    config = served_config(docs, tmp_path, monkeypatch)
    # Two workers per pod of 4 GPUs, each of TP 2: one GPU per rank, 2 per actor.
    assert config.pools.gpus_per_worker == 1.0 and config.pools.num_decode == 2
    assert config.engine_for("decode").parallel.tensor_parallel_size == 2


@pytest.mark.parametrize("values", list(VALUES), ids=list(VALUES))
def test_worker_groups_offer_what_the_pools_need(render: Render, values: str) -> None:
    """Ray's own reading of the RayCluster (its KubeRay autoscaler) finds the
    custom resources and GPUs that the pools in the config ask for."""
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr

    docs = render(VALUES[values])
    cluster = copy.deepcopy(one(docs, "RayCluster"))
    cluster["metadata"]["namespace"] = "serving"  # the API server fills it in
    node_types = _derive_autoscaling_config_from_ray_cr(cluster)["available_node_types"]
    pools = EXPECTED[values].pools
    for role, num_workers in (("prefill", pools.num_prefill), ("decode", pools.num_decode)):
        group = worker_groups(docs)[role]
        resources = node_types[role]["resources"]
        assert resources[role] * group["replicas"] == num_workers
        assert resources.get("GPU", 0) == resources[role] * pools.gpus_per_worker
        assert "prefill" not in node_types["headgroup"]["resources"]
        assert "decode" not in node_types["headgroup"]["resources"]


def test_gpu_groups_request_gpus_and_place_on_gpu_nodes(render: Render) -> None:
    for role, group in worker_groups(render((GPU_VALUES,))).items():
        spec = group["template"]["spec"]
        container = spec["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
        assert container["resources"]["requests"]["nvidia.com/gpu"] == 8
        assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true", "pdserve.dev/pool": role}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 1
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
    for group in worker_groups(render()).values():
        assert "nvidia.com/gpu" not in group["template"]["spec"]["containers"][0]["resources"]["limits"]


def test_head_serves_grpc_with_native_probes(render: Render) -> None:
    docs = render()
    head = head_container(docs)
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert ports["grpc"] == 50051 and ports["http"] == 8000 and ports["metrics"] == 9400
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert head[probe]["grpc"] == {"port": 50051}  # no service name: the server's overall health
    assert "--address auto --host 0.0.0.0" in head["args"][0]
    annotations = one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == "9400"


def test_only_the_frontend_is_exposed(render: Render) -> None:
    docs = render()
    service = one(docs, "Service")
    assert service["spec"]["type"] == "ClusterIP"
    assert {p["port"] for p in service["spec"]["ports"]} == {50051, 8000, 9400}
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "head"
    head_spec = one(docs, "RayCluster")["spec"]["headGroupSpec"]
    assert head_spec["serviceType"] == "ClusterIP"
    assert head_spec["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    assert not {p["containerPort"] for p in head_container(docs)["ports"]} & (RAY_PORTS - {6379})
    for doc in docs:
        if doc["kind"] == "Service":
            assert not {p["port"] for p in doc["spec"]["ports"]} & RAY_PORTS


def test_http_api_off_exposes_only_grpc_and_metrics(render: Render) -> None:
    docs = render(sets=("config.server.http=false",))
    assert {p["port"] for p in one(docs, "Service")["spec"]["ports"]} == {50051, 9400}
    assert "http" not in {p["name"] for p in head_container(docs)["ports"]}


def test_cluster_secret_comes_from_a_secret(render: Render) -> None:
    docs = render()
    secret = one(docs, "Secret")
    env = {e["name"]: e for e in head_container(docs)["env"]}
    ref = env["PDSERVE_CLUSTER_SECRET"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": secret["metadata"]["name"], "key": "cluster-secret"}
    import base64

    assert len(base64.b64decode(secret["data"]["cluster-secret"])) >= 16  # cluster_secret() needs 16 bytes
    assert "value" not in env["PDSERVE_CLUSTER_SECRET"]

    docs = render(sets=("clusterSecret.existingSecret=my-secret", "clusterSecret.key=token"))
    assert not [d for d in docs if d["kind"] == "Secret"]
    ref = {e["name"]: e for e in head_container(docs)["env"]}["PDSERVE_CLUSTER_SECRET"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "my-secret", "key": "token"}


def test_ray_token_auth_is_on(render: Render) -> None:
    assert one(render(), "RayCluster")["spec"]["authOptions"] == {"mode": "token"}


def test_tls_and_an_api_key_from_secrets(render: Render, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render(sets=("auth.tlsSecret=pdserve-tls", "auth.apiKeySecret=pdserve-token"))
    server = served_config(docs, tmp_path, monkeypatch).server
    assert (server.tls_cert, server.tls_key) == ("/etc/pdserve-tls/tls.crt", "/etc/pdserve-tls/tls.key")
    assert server.api_key_file == "/etc/pdserve-api-key/api-key"
    head = head_container(docs)
    mounts = {m["name"]: m["mountPath"] for m in head["volumeMounts"]}
    assert mounts["tls"] == "/etc/pdserve-tls" and mounts["api-key"] == "/etc/pdserve-api-key"
    volumes = {v["name"]: v for v in one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "pdserve-tls"
    assert volumes["api-key"]["secret"]["secretName"] == "pdserve-token"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):  # kubelet's gRPC probes speak no TLS
        assert head[probe]["tcpSocket"] == {"port": 50051} and "grpc" not in head[probe]
    default = served_config(render(), tmp_path, monkeypatch).server
    assert (default.tls_cert, default.api_key_file) == ("", "")


def test_an_admin_token_from_a_secret(render: Render, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render(sets=("auth.adminTokenSecret=pdserve-admin",))
    assert served_config(docs, tmp_path, monkeypatch).server.admin_token_file == "/etc/pdserve-admin-token/admin-token"
    mounts = {m["name"]: m["mountPath"] for m in head_container(docs)["volumeMounts"]}
    assert mounts["admin-token"] == "/etc/pdserve-admin-token"
    volumes = {v["name"]: v for v in one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]["volumes"]}
    assert volumes["admin-token"]["secret"]["secretName"] == "pdserve-admin"
    assert served_config(render(), tmp_path, monkeypatch).server.admin_token_file == ""  # off by default


def test_tenants_from_a_secret_and_the_priority_policy(render: Render, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render(sets=("auth.tenantsSecret=pdserve-tenants", "config.engine.scheduler.policy=priority",
                        "config.admission.max_waiting_per_worker=16"))
    config = served_config(docs, tmp_path, monkeypatch)
    assert config.server.tenants_file == "/etc/pdserve-tenants/tenants.yaml"
    assert config.engine.scheduler.policy == "priority" and config.admission.max_waiting_per_worker == 16
    mounts = {m["name"]: m for m in head_container(docs)["volumeMounts"]}
    assert mounts["tenants"]["mountPath"] == "/etc/pdserve-tenants" and mounts["tenants"]["readOnly"]
    volumes = {v["name"]: v for v in one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]["volumes"]}
    assert volumes["tenants"]["secret"]["secretName"] == "pdserve-tenants"
    default = served_config(render(), tmp_path, monkeypatch)
    assert (default.server.tenants_file, default.engine.scheduler.policy) == ("", "fcfs")
    assert "tenants" not in {m["name"] for m in head_container(render())["volumeMounts"]}


def test_a_tenants_file_named_twice_fails(helm: str) -> None:
    proc = run_helm(helm, *template_args(sets=("auth.tenantsSecret=t", "config.server.tenants_file=/x.yaml")))
    assert proc.returncode != 0
    assert "config.server.tenants_file and auth.tenantsSecret both name the tenants file" in proc.stderr, proc.stderr


def test_a_bad_policy_is_refused_by_the_schema(helm: str) -> None:
    proc = run_helm(helm, *template_args(sets=("config.engine.scheduler.policy=lifo",)))
    assert proc.returncode != 0 and "policy" in proc.stderr, proc.stderr


def test_client_certificates_from_a_ca_secret(render: Render, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    docs = render(sets=("auth.tlsSecret=pdserve-tls", "auth.clientCaSecret=pdserve-client-ca"))
    server = served_config(docs, tmp_path, monkeypatch).server
    assert server.tls_client_ca == "/etc/pdserve-client-ca/ca.crt"
    assert (server.tls_cert, server.tls_key) == ("/etc/pdserve-tls/tls.crt", "/etc/pdserve-tls/tls.key")
    mounts = {m["name"]: m for m in head_container(docs)["volumeMounts"]}
    assert mounts["client-ca"]["mountPath"] == "/etc/pdserve-client-ca" and mounts["client-ca"]["readOnly"]
    volumes = {v["name"]: v for v in one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]["volumes"]}
    assert volumes["client-ca"]["secret"]["secretName"] == "pdserve-client-ca"
    other_key = render(sets=("auth.tlsSecret=t", "auth.clientCaSecret=c", "auth.clientCaSecretKey=bundle.pem"))
    assert served_config(other_key, tmp_path, monkeypatch).server.tls_client_ca == "/etc/pdserve-client-ca/bundle.pem"
    plain = render(sets=("auth.tlsSecret=pdserve-tls",))
    assert served_config(plain, tmp_path, monkeypatch).server.tls_client_ca == ""
    assert "client-ca" not in {m["name"] for m in head_container(plain)["volumeMounts"]}


def test_a_client_ca_secret_without_tls_fails(helm: str) -> None:
    proc = run_helm(helm, *template_args(sets=("auth.clientCaSecret=pdserve-client-ca",)))
    assert proc.returncode != 0
    assert "auth.clientCaSecret (client certificates, mutual TLS) needs auth.tlsSecret" in proc.stderr, proc.stderr
