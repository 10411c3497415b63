"""pdserve started from the checkout's root serves as it does from any other folder.

Ray puts the driver's working directory on every worker's path, and transformers (5.25 on)
imports Hugging Face's `kernels` when it loads a config: a checkout's `kernels/` there killed
every worker. These tests start from the checkout's root on purpose, and hold in both of
CI's environments (`make test-newest` runs them with the newest releases)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.engine.sampling import SamplingParams
from tests.cluster.streams import collect, free_port, serve_process

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _outside_checkout(places: list[str]) -> bool:
    """No place is in one of the checkout's folders (an environment inside the checkout,
    such as `.venv/`, is not one: its packages are installed ones)."""
    folders = [p for p in ROOT.iterdir() if p.is_dir() and p.name.isidentifier()]
    return not any(p and Path(p).resolve().is_relative_to(f) for p in places for f in folders)


def test_no_worker_or_rank_finds_a_checkout_folder(tmp_path):
    """In a Ray actor, and in a process it spawns as a tensor-parallel rank is spawned, every
    top-level folder name of the checkout is not found or found outside the checkout (this
    holds whatever releases are installed: it does not wait for one to collide)."""
    proc = subprocess.run([sys.executable, "-m", "tests.cluster.checkout_probe", str(tmp_path / "child.json")],
                          cwd=ROOT, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"kernels", "proto", "engine", "cluster", "tests"} <= set(report["names"]), report["names"]
    for where in ("actor", "child"):
        found = report[where]["found"]
        assert set(found) == set(report["names"])
        shadowing = {name: places for name, places in found.items() if not _outside_checkout(places)}
        assert shadowing == {}, (where, shadowing, report[where]["sys_path"])


def test_a_checkout_folder_does_not_shadow_an_installed_package():
    """With the checkout's root first on sys.path (any `python -m tool` run there), `kernels`
    and `proto` are Hugging Face's and proto-plus's: our folders of those names are namespace
    portions, and an installed regular package wins over them."""
    code = ("import importlib.util, json; "
            "print(json.dumps({n: importlib.util.find_spec(n).origin for n in ('kernels', 'proto')}))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    origins = json.loads(proc.stdout)
    for name, origin in origins.items():
        assert origin and origin.endswith(f"{name}/__init__.py") and _outside_checkout([origin]), origins


@pytest.fixture(scope="module")
def served(model_folder, tmp_path_factory) -> Iterator[tuple[int, int]]:
    """`pdserve serve` (the installed command) started in the checkout's root, disaggregated
    (a prefill and a decode worker, KV over UCX), with a config file and a model folder both
    given as paths relative to it: the workers run in another folder and must get them absolute."""
    config = tmp_path_factory.mktemp("from-checkout") / "serve.yaml"
    config.write_text("engine:\n  model: {device: cpu, dtype: float32}\n  cache: {cpu_kv_cache_gib: 0.25}\n"
                      "pools: {gpus_per_worker: 0}\n")
    port, http_port = free_port(), free_port()
    command = [str(Path(sys.executable).parent / "pdserve"), "serve", "--config", os.path.relpath(config, ROOT),
               "--model", os.path.relpath(model_folder, ROOT), "--port", str(port), "--http-port", str(http_port),
               "--metrics-port", str(free_port())]
    with serve_process(command, cwd=ROOT):
        yield port, http_port


def test_serves_grpc_and_http_streams_from_the_checkouts_root(served, hf_model, tokenizer):
    """A greedy request streamed through gRPC and through the OpenAI HTTP API gives the
    tokens Hugging Face's greedy `generate` gives."""
    import openai
    import torch

    port, http_port = served
    prompt = "The capital of France is"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        hf = hf_model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist()

    streamed = collect(f"127.0.0.1:{port}", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert streamed.token_ids == hf
    assert streamed.num_responses > 1  # streamed, not one reply

    with openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", max_retries=0,
                       timeout=120) as client:
        model = client.models.list().data[0].id
        chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == tokenizer.decode(hf)
    assert len(chunks) > 1


def test_every_ray_start_goes_through_the_driver():
    """The neutral working directory is applied where Ray is started or joined, once: no other
    module of pdserve calls ray.init (so the Docker image, the Helm chart's head command and
    deploy/ray/start-pdserve.sh, which all run `pdserve serve`, get it too)."""
    import ast

    calls = []
    for folder in ("cluster", "decode_node", "engine", "kernels", "kv_transport", "prefill_node", "proto"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_bytes())):
                if isinstance(node, ast.Call) and ast.unparse(node.func) == "ray.init":
                    calls.append(path.relative_to(ROOT).as_posix())
    assert calls == ["cluster/ray_driver.py", "cluster/ray_driver.py"], calls
    for script in ("deploy/ray/start-pdserve.sh", "deploy/helm/pdserve/templates/raycluster.yaml"):
        assert "exec pdserve serve " in (ROOT / script).read_text(), script
