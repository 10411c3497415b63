"""The chart renders, lints, and every manifest validates against its schema:
Kubernetes core kinds against kubernetes-validate's bundled schemas (offline),
KubeRay kinds against KubeRay's CRDs vendored in deploy/kuberay-crds/; bad values are
refused by values.schema.json with a message naming the value."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import shutil
import types
import typing
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from pdserve.cluster.settings.config import ServeConfig
from pdserve.cluster.settings.config_tree import config_fields as serve_config_fields
from tests.deploy.conftest import CHART, GPU_VALUES, ROOT, Render, one, run_helm, template_args

K8S_VERSION = "1.30"  # the kubectl the helm package ships beside it; gRPC probes are GA since 1.27
CRD_DIR = ROOT / "deploy" / "kuberay-crds"
VALUES = {"default": (), "gpu-2node": (GPU_VALUES,)}


def _strict(schema: Any) -> Any:
    """The CRD schema with unknown fields refused: the API server would silently
    prune them, which hides typos such as `nodeSelecter`."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.cache
def crd_validator(group: str, kind: str, version: str) -> jsonschema.Draft7Validator:
    for path in sorted(CRD_DIR.glob(f"{group}_*.yaml")):
        crd = yaml.safe_load(path.read_text())
        if crd["spec"]["names"]["kind"] != kind:
            continue
        for v in crd["spec"]["versions"]:
            if v["name"] == version:
                return jsonschema.Draft7Validator(_strict(v["schema"]["openAPIV3Schema"]))
    raise LookupError(f"no CRD schema for {group}/{version} {kind} in {CRD_DIR}")


def validate(doc: dict[str, Any]) -> None:
    group, _, version = doc["apiVersion"].rpartition("/")
    if group == "ray.io":
        errors = sorted(crd_validator(group, doc["kind"], version).iter_errors(doc), key=str)
        assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors[:10])
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def pod_templates(cluster: dict[str, Any]) -> dict[str, dict[str, Any]]:
    spec = cluster["spec"]
    groups = {"head": spec["headGroupSpec"]}
    groups.update({g["groupName"]: g for g in spec["workerGroupSpecs"]})
    return {name: g["template"] for name, g in groups.items()}


def test_crd_schemas_are_there() -> None:
    assert (CRD_DIR / "ray.io_rayclusters.yaml").is_file(), f"KubeRay CRDs missing under {CRD_DIR}"


@pytest.mark.parametrize("values", list(VALUES), ids=list(VALUES))
def test_helm_lint(helm: str, values: str) -> None:
    args = ["lint", str(CHART), "--strict"]
    for f in VALUES[values]:
        args += ["-f", str(f)]
    proc = run_helm(helm, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("values", list(VALUES), ids=list(VALUES))
def test_rendered_manifests_validate(render: Render, values: str) -> None:
    docs = render(VALUES[values])
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ConfigMap", "RayCluster", "Secret", "Service"]
    for doc in docs:
        validate(doc)
    # The pod templates inside the RayCluster, against the core PodTemplate schema too.
    for name, template in pod_templates(one(docs, "RayCluster")).items():
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name},
                                      "template": template}, K8S_VERSION, strict=True)


def test_manifests_with_client_authentication_validate(render: Render) -> None:
    docs = render(sets=("auth.tlsSecret=t", "auth.clientCaSecret=c", "auth.apiKeySecret=k", "auth.adminTokenSecret=a"))
    for doc in docs:
        validate(doc)
    for name, template in pod_templates(one(docs, "RayCluster")).items():
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name},
                                      "template": template}, K8S_VERSION, strict=True)


def test_scaled_out_frontends_validate_and_stand_behind_the_service(render: Render) -> None:
    """frontends.enabled: a frontend Deployment of `replicas` pods behind the Service, the
    head's pdserve running the control plane apart (server.control_plane in its config)."""
    docs = render(sets=("frontends.enabled=true", "frontends.replicas=3", "auth.apiKeySecret=k",
                        "auth.adminTokenSecret=a"))
    assert sorted(d["kind"] for d in docs) == ["ConfigMap", "Deployment", "RayCluster", "Secret", "Service"]
    for doc in docs:
        validate(doc)
    deployment, service = one(docs, "Deployment"), one(docs, "Service")
    assert deployment["spec"]["replicas"] == 3
    pod = deployment["spec"]["template"]
    assert service["spec"]["selector"] == pod["metadata"]["labels"]
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "frontend"
    container = pod["spec"]["containers"][0]
    assert "pdserve frontend --join auto --namespace pdserve" in container["args"][0]
    assert {p["name"] for p in container["ports"]} == {"grpc", "http", "metrics"}
    config = yaml.safe_load(one(docs, "ConfigMap")["data"]["config.yaml"])
    assert config["server"]["control_plane"] is True and config["ray"]["namespace"] == "pdserve"
    # Off (the default), the head serves: its config has no control plane of its own.
    default = yaml.safe_load(one(render(), "ConfigMap")["data"]["config.yaml"])
    assert default["server"]["control_plane"] is False
    assert one(render(), "Service")["spec"]["selector"]["app.kubernetes.io/component"] == "head"


def test_frontend_pods_mount_every_file_the_config_names(render: Render) -> None:
    """A joined frontend reads the control plane's config (`pdserve frontend --join`): every file
    its `server` section names (TLS, client CA, API key, admin token, tenants) must be mounted
    on the frontend pods too, not only on the head."""
    docs = render(sets=("frontends.enabled=true", "auth.tlsSecret=t", "auth.clientCaSecret=c",
                        "auth.apiKeySecret=k", "auth.adminTokenSecret=a", "auth.tenantsSecret=n"))
    server = yaml.safe_load(one(docs, "ConfigMap")["data"]["config.yaml"])["server"]
    files = [v for k, v in server.items() if isinstance(v, str) and v.startswith("/etc/pdserve-")]
    assert len(files) >= 6, server  # cert, key, client CA, API key, admin token, tenants
    container = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    mounted = {m["mountPath"] for m in container["volumeMounts"]}
    assert {str(Path(f).parent) for f in files} <= mounted, (files, mounted)


def test_crd_validation_catches_mistakes(render: Render) -> None:
    cluster = copy.deepcopy(one(render(), "RayCluster"))
    cluster["spec"]["workerGroupSpecs"][0]["replicas"] = "two"
    cluster["spec"]["headGroupSpec"]["nodeSelecter"] = {}
    errors = list(crd_validator("ray.io", "RayCluster", "v1").iter_errors(cluster))
    assert len(errors) == 2, [e.message for e in errors]


def test_service_monitor_option(render: Render) -> None:
    docs = render(sets=("metrics.serviceMonitor.enabled=true",))
    monitor = one(docs, "ServiceMonitor")  # no offline schema for prometheus-operator kinds: check by hand
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    service = one(docs, "Service")
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()


BAD_VALUES = {
    "zero decode replicas": ("decode.replicas=0", "decode.replicas: Must be greater than or equal to 1"),
    "negative gpus": ("decode.gpus=-1", "decode.gpus: Must be greater than or equal to 0"),
    "unknown model source": ("config.engine.model.source=ftp://x", "config.engine.model.source: Does not match"),
    "unknown pool mode": ("config.pools.mode=split", "config.pools.mode: config.pools.mode must be one of"),
    "pool sizes set by hand": ("config.pools.num_decode=3", "Additional property num_decode is not allowed"),
    # The router's LRU guess of each worker's cache is gone (it routes on the KV index now).
    "a removed router field": ("config.router.max_hashes_per_worker=100",
                               "Additional property max_hashes_per_worker is not allowed"),
}


@pytest.mark.parametrize("case", list(BAD_VALUES), ids=list(BAD_VALUES))
def test_bad_values_fail_with_a_clear_message(helm: str, case: str) -> None:
    setting, message = BAD_VALUES[case]
    proc = run_helm(helm, *template_args(sets=(setting,)))
    assert proc.returncode != 0, f"helm template accepted {setting}"
    assert message in proc.stderr, proc.stderr
    proc = run_helm(helm, "lint", str(CHART), "--set", setting)
    assert proc.returncode != 0, f"helm lint accepted {setting}"
    assert message in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_mismatched_gpus_per_worker_fail(helm: str) -> None:
    proc = run_helm(helm, *template_args(sets=("prefill.gpus=2",)))
    assert proc.returncode != 0
    assert "must equal decode.gpus/(decode.workersPerPod x decode TP)" in proc.stderr, proc.stderr


# Serve-config fields the chart sets itself from the pods and auth.* Secrets, so
# values.schema.json refuses them under config: (a value there would be overwritten).
CHART_OWNED = {
    "server.host", "server.tls_cert", "server.tls_key", "server.tls_client_ca", "server.api_key_file",
    "server.admin_token_file", "server.frontends", "server.control_plane", "ray.namespace",
    "pools.num_prefill", "pools.num_decode", "pools.gpus_per_worker", "pools.prefill_resource",
    "pools.decode_resource", "ray.address", "ray.node_ip_address",
}


def config_fields() -> dict[str, Any]:
    """Every leaf field of the serve config, as a dotted path (`engine.model.source`) to its
    type: the walk `pdserve serve`'s flags are made from (cluster.config_tree.config_fields)."""
    return {f.path: f.kind for f in serve_config_fields()}


def json_types(kind: Any) -> set[str]:
    """The JSON types a YAML value of the Python type `kind` may take."""
    if kind is type(None):
        return {"null"}
    args = typing.get_args(kind)
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return set().union(*(json_types(a) for a in args))
    if typing.get_origin(kind) in (tuple, list, frozenset):
        return {"array"}
    simple = {str: "string", Path: "string", bool: "boolean", int: "integer", float: "number"}
    assert kind in simple, f"no JSON type for {kind!r}: teach json_types"
    return {simple[kind]}


def schema_fields(node: dict[str, Any], prefix: str = "") -> dict[str, dict[str, Any]]:
    """The schema's leaves under `config`, as dotted paths to their entries."""
    leaves: dict[str, dict[str, Any]] = {}
    for name, entry in node["properties"].items():
        if entry.get("type") == "object":
            assert entry.get("additionalProperties") is False, f"config.{prefix}{name} must refuse unknown keys"
            leaves.update(schema_fields(entry, f"{prefix}{name}."))
        else:
            leaves[prefix + name] = entry
    return leaves


def config_schema() -> dict[str, Any]:
    return json.loads((CHART / "values.schema.json").read_text())["properties"]["config"]


def test_the_walk_reads_the_sections_config_from_dict_reads() -> None:
    from pdserve.cluster.settings.config import _ENGINE_SECTIONS, _SECTIONS

    sections = {path.rpartition(".")[0] for path in config_fields()}
    assert sections == {f"engine.{k}" for k in _ENGINE_SECTIONS} | set(_SECTIONS) | {"pools.planner"}


def test_the_schema_covers_every_serve_config_field_and_nothing_else() -> None:
    """values.schema.json (additionalProperties: false) and cluster/settings/config.py cannot drift:
    every field a user may set has an entry of its JSON type, and no entry names a field
    the config lacks."""
    fields, entries = config_fields(), schema_fields(config_schema())
    assert not CHART_OWNED - set(fields), f"CHART_OWNED names no field: {sorted(CHART_OWNED - set(fields))}"
    missing = sorted(set(fields) - set(entries) - CHART_OWNED)
    assert not missing, f"values.schema.json config lacks serve-config fields: {missing}"
    unknown = sorted(set(entries) - set(fields))
    assert not unknown, f"values.schema.json config has keys cluster/settings/config.py lacks: {unknown}"
    owned = sorted(set(entries) & CHART_OWNED)
    assert not owned, f"values.schema.json lets config set what the chart sets itself: {owned}"
    for path, entry in entries.items():
        declared = entry["type"] if isinstance(entry["type"], list) else [entry["type"]]
        assert set(declared) == json_types(fields[path]), \
            f"config.{path}: schema type {declared}, but the config's field is {fields[path]}"


def test_the_schema_takes_every_default_and_refuses_what_the_config_refuses() -> None:
    """The config's own defaults validate; a value under a field's minimum or outside its
    enum is refused by both the schema and the config."""
    from pdserve.cluster.settings.config import config_from_dict

    schema = config_schema()
    defaults = dataclasses.asdict(ServeConfig())
    for path in CHART_OWNED:
        section, name = path.split(".")
        del defaults[section][name]
    defaults.pop("ray")
    defaults["engine"]["model"]["cache_dir"] = "/var/cache/pdserve"
    defaults["kv_transport"]["allowed_transports"] = list(defaults["kv_transport"]["allowed_transports"])
    jsonschema.validate(defaults, schema)
    for path, entry in schema_fields(schema).items():
        section, _, name = path.rpartition(".")
        bad = None
        if "enum" in entry:
            bad = "no-such-value" if "string" in str(entry["type"]) else 3
        elif "minimum" in entry:
            bad = entry["minimum"] - 1
        elif "exclusiveMinimum" in entry:
            bad = entry["exclusiveMinimum"]
        if bad is None or path in {"server.port", "server.http_port"}:  # the chart needs fixed ports; 0 is fine
            continue
        values: dict[str, Any] = {}
        node = values
        for part in section.split("."):
            node = node.setdefault(part, {})
        node[name] = bad
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(values, {**schema, "required": []})
        if path == "engine.model.max_model_len":  # only the model knows its own length
            continue
        with pytest.raises(ValueError):
            config_from_dict(values)


def test_chart_owned_fields_are_the_ones_the_chart_sets(render: Render) -> None:
    docs = render(sets=("auth.tlsSecret=t", "auth.clientCaSecret=c", "auth.apiKeySecret=k", "auth.adminTokenSecret=a"))
    rendered = yaml.safe_load(one(docs, "ConfigMap")["data"]["config.yaml"])
    for path in CHART_OWNED:
        section, name = path.split(".")
        assert name in rendered[section], f"the chart does not set {path}, so config: should be able to"


def test_notes_tell_how_to_call_it(helm: str, tmp_path: Path) -> None:
    # `helm install --dry-run` wants a cluster; render NOTES.txt through a
    # copy of the chart that puts its text in a ConfigMap instead.
    chart = tmp_path / "pdserve"
    shutil.copytree(CHART, chart)
    notes = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "NOTES.txt").unlink()
    (chart / "templates" / "_notes.tpl").write_text('{{- define "notes" -}}\n' + notes + '{{- end -}}\n')
    (chart / "templates" / "notes.yaml").write_text(
        'apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\ndata:\n  notes: {{ include "notes" . | quote }}\n')
    proc = run_helm(helm, "template", "pd", str(chart), "--namespace", "serving",
                    "--show-only", "templates/notes.yaml")
    assert proc.returncode == 0, proc.stderr
    text = yaml.safe_load(proc.stdout)["data"]["notes"]
    assert "kubectl --namespace serving port-forward svc/pd-pdserve 50051:50051" in text
    assert "pdserve generate --target 127.0.0.1:50051" in text
    assert "grpcurl -plaintext" in text and "pdserve.v1.Generation/Generate" in text
    assert "1 prefill + 1 decode workers" in text
