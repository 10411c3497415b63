"""pdserve's folders are `pdserve.*`, never generic top-level names.

`kernels` is also a Hugging Face package that transformers probes for (and would try to
load kernels from a hub with); `proto` is proto-plus's import name. So the folders import
as `pdserve.kernels`, `pdserve.proto`, ... (ruff's TID251 and import-linter enforce it in
`make lint`; this test holds in environments where lint does not run, such as
`make test-newest`), and what this environment resolves for a bare `kernels` is whatever
else is installed, never the checkout. tests/test_packaging.py does the same for a wheel
installed beside those packages.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_packaging import FOLDERS

ROOT = Path(__file__).resolve().parents[2]


def _sources(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*.py")
            if "__pycache__" not in p.parts}


@pytest.mark.parametrize("name", FOLDERS)
def test_pdserve_packages_are_the_checkouts_folders(name):
    package = importlib.import_module(f"pdserve.{name}")
    # kernels/ and proto/ are namespace packages: an editable install adds its finder's
    # placeholder, which is no folder, to their __path__.
    (folder,) = {Path(p).resolve() for p in package.__path__ if Path(p).is_dir()}
    # An editable install maps pdserve.<name> to the checkout; a wheel install (the newest
    # environment's) holds a copy of it under site-packages/pdserve.
    assert folder == ROOT / name or (folder.parent.name == "pdserve" and _sources(folder) == _sources(ROOT / name)), \
        folder


def _bare_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_bytes(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names if n.split(".")[0] in FOLDERS]
    return found


def test_no_code_imports_a_folder_by_its_bare_name():
    files = [p for top in (*FOLDERS, "tests", "benchmarks") for p in (ROOT / top).rglob("*.py")]
    # test_packaging imports Hugging Face's kernels and proto-plus by their own names, on purpose.
    bare = [hit for p in files if p != ROOT / "tests" / "test_packaging.py" for hit in _bare_imports(p)]
    assert not bare, "import these as pdserve.<folder>:\n" + "\n".join(bare)


# What the environment itself (site-packages, the editable install's finder) resolves each
# bare name to, from an empty folder with the checkout off the path.
PROBE = """
import importlib.metadata, importlib.util, json, sys
found = {}
for name in sys.argv[1:]:
    spec = importlib.util.find_spec(name)
    found[name] = None if spec is None else [spec.origin, list(spec.submodule_search_locations or [])]
try:
    kernels_files = [str(f.locate()) for f in importlib.metadata.distribution("kernels").files]
except importlib.metadata.PackageNotFoundError:
    kernels_files = None
print(json.dumps({"found": found, "kernels_files": kernels_files}))
"""


def test_bare_names_are_never_the_checkout(tmp_path):
    def off_root(entry: str) -> bool:
        return bool(entry) and Path(entry).resolve() != ROOT

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(off_root, os.environ.get("PYTHONPATH", "").split(
        os.pathsep))))
    run = subprocess.run([sys.executable, "-c", PROBE, *FOLDERS], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    probe = json.loads(run.stdout)
    for name, spec in probe["found"].items():
        if spec is None:
            continue
        origin, locations = spec
        paths = [Path(p).resolve() for p in [origin, *locations] if p]
        assert paths and not any(p.is_relative_to(ROOT / folder) for p in paths for folder in FOLDERS), (name, spec)
    if probe["kernels_files"] is not None:  # Hugging Face's kernels is installed: `kernels` is it
        origin = Path(probe["found"]["kernels"][0]).resolve()
        assert origin in {Path(f).resolve() for f in probe["kernels_files"]}, f"{origin} is not Hugging Face's kernels"


@pytest.mark.slow
def test_transformers_still_loads_a_model(model_folder):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_folder), dtype=torch.float32)
    assert model.config.model_type == "llama"
