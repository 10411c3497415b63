"""The chart renders, lints, and every manifest validates against its schema:
Kubernetes core kinds against kubernetes-validate's bundled schemas (offline),
KubeRay kinds against KubeRay's CRDs vendored in deploy/kuberay-crds/; bad values are
refused by values.schema.json with a message naming the value."""

from __future__ import annotations

import copy
import functools
import shutil
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

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
    docs = render(sets=("auth.tlsSecret=t", "auth.clientCaSecret=c", "auth.apiKeySecret=k"))
    for doc in docs:
        validate(doc)
    for name, template in pod_templates(one(docs, "RayCluster")).items():
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name},
                                      "template": template}, K8S_VERSION, strict=True)


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


def test_schema_names_only_real_config_fields() -> None:
    """values.schema.json spells config keys as cluster/config.py's dataclasses do."""
    import dataclasses
    import json

    from pdserve.cluster.config import _ENGINE_SECTIONS, _SECTIONS

    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["config"]["properties"]
    sections = {f"engine.{k}": (c, schema["engine"]["properties"][k]) for k, c in _ENGINE_SECTIONS.items()}
    sections.update({k: (c, schema[k]) for k, c in _SECTIONS.items() if k in schema})
    for where, (cls, section) in sections.items():
        unknown = set(section["properties"]) - {f.name for f in dataclasses.fields(cls)}
        assert not unknown, f"values.schema.json config.{where} has keys {cls.__name__} lacks: {sorted(unknown)}"



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
