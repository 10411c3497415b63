"""pdserve installs as one package, `pdserve`, and lives beside packages that own the
generic names its folders have: Hugging Face's `kernels` (which transformers probes for)
and proto-plus's `proto`."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("cluster", "decode_node", "engine", "kernels", "kv_transport", "prefill_node", "proto")


def test_pyproject_lists_every_package_folder():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    # A package is a folder of modules, with or without __init__.py: kernels/ and proto/ have
    # none (namespace portions: a checkout's root on sys.path cannot shadow the installed
    # `kernels` and `proto`, see tests/engine/test_namespaces.py).
    found = {"pdserve." + ".".join(module.parent.relative_to(ROOT).parts)
             for folder in FOLDERS for module in (ROOT / folder).rglob("*.py") if "__pycache__" not in module.parts}
    assert listed == found


# Run from an empty folder with only the installed wheel and the project's environment on
# the path: every import below resolves to site-packages, none to this checkout.
BESIDE = """
import sys, pathlib
import kernels, proto, torch
import pdserve.engine
from pdserve.cluster.cli import main
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sampling import SamplingParams

target = pathlib.Path(sys.argv[1])
assert pathlib.Path(pdserve.engine.__file__).is_relative_to(target), pdserve.engine.__file__
assert not pathlib.Path(kernels.__file__).is_relative_to(target), kernels.__file__
# What transformers probes (importlib's spec of `kernels`) is Hugging Face's distribution.
import importlib.metadata, importlib.util
files = {str(f) for f in importlib.metadata.distribution("kernels").files}
assert pathlib.Path(importlib.util.find_spec("kernels").origin).as_posix().endswith("kernels/__init__.py")
assert "kernels/__init__.py" in files

# proto-plus works: a message type round-trips.
class Point(proto.Message):
    x = proto.Field(proto.INT32, number=1)
assert Point.deserialize(Point.serialize(Point(x=7))).x == 7

# Hugging Face's kernels works: a layer marked for hub kernels still runs its own forward.
@kernels.use_kernel_forward_from_hub("SiluAndMul")
class SiluAndMul(torch.nn.Module):
    def forward(self, x):
        a, b = x.chunk(2, -1)
        return torch.nn.functional.silu(a) * b
assert SiluAndMul()(torch.ones(1, 4)).shape == (1, 2)

# pdserve works: greedy tokens from the tiny dummy model.
engine = Engine(EngineConfig(model=ModelConfig(source="dummy:tiny", device="cpu")))
out = engine.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
print(" ".join(map(str, out.token_ids)))
"""


def test_the_wheel_installs_beside_kernels_and_proto_plus(tmp_path):
    dist, target, empty = tmp_path / "dist", tmp_path / "site", tmp_path / "cwd"
    empty.mkdir()
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", dist, ROOT], check=True, timeout=300)
    (wheel,) = dist.glob("pdserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {Path(name).parts[0] for name in names if ".dist-info/" not in name} == {"pdserve"}
    assert {"pdserve/proto/v1/generation.proto", "pdserve/cluster/bench/synthetic_chat.jsonl"} <= set(names)
    subprocess.run([*pip, "install", "--no-deps", "--target", target, wheel], check=True, timeout=300)

    # -S drops the environment's site-packages (where the editable install maps pdserve to
    # this checkout); they come back on PYTHONPATH after the wheel's folder.
    site_packages = [p for p in sys.path if p.endswith("site-packages")]
    env = {"PYTHONPATH": ":".join([str(target), *site_packages]), "PATH": "/usr/bin:/bin"}
    run = subprocess.run([sys.executable, "-S", "-c", BESIDE, str(target)], cwd=empty, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr

    from pdserve.engine.config import EngineConfig, ModelConfig
    from pdserve.engine.engine import Engine
    from pdserve.engine.sampling import SamplingParams

    engine = Engine(EngineConfig(model=ModelConfig(source="dummy:tiny", device="cpu")))
    here = engine.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    assert run.stdout.split() == [str(t) for t in here.token_ids]
