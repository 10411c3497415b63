"""deploy/docker/Dockerfile, checked statically (no Docker engine here): a CUDA
base, every COPY source exists and passes its ignore file, and every package
pyproject.toml installs is copied in."""

from __future__ import annotations

import fnmatch
import re
import tomllib

from tests.deploy.conftest import ROOT

DOCKER = ROOT / "deploy" / "docker"


def instructions() -> list[tuple[str, str]]:
    text = (DOCKER / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def copy_sources() -> list[str]:
    sources = []
    for op, args in instructions():
        if op == "COPY":
            words = [w for w in args.split() if not w.startswith("--")]
            sources += words[:-1]
    return sources


def test_base_image_is_cuda() -> None:
    froms = [args for op, args in instructions() if op == "FROM"]
    assert len(froms) == 1 and re.match(r"nvidia/cuda:12\.\d+\.\d+-", froms[0])


def test_copy_sources_exist_and_pass_the_ignore_file() -> None:
    rules = [r.strip() for r in (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
             if r.strip() and not r.startswith("#")]

    def included(path: str) -> bool:
        keep = True
        for rule in rules:  # last matching rule wins, as in Docker
            negate = rule.startswith("!")
            if fnmatch.fnmatch(path, rule.lstrip("!")):
                keep = negate
        return keep

    for source in copy_sources():
        assert (ROOT / source).exists(), f"COPY {source}: no such file in the repo"
        assert included(source), f"COPY {source}: excluded by Dockerfile.dockerignore"


def test_every_installed_package_is_copied() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    # pdserve.engine.models -> engine: the folders under the repository root that pdserve maps.
    packages = {p.split(".")[1] for p in pyproject["tool"]["setuptools"]["packages"]}
    assert packages <= set(copy_sources()), f"not copied into the image: {sorted(packages - set(copy_sources()))}"


def test_installs_pinned_and_runs_pdserve() -> None:
    runs = " ".join(args for op, args in instructions() if op == "RUN")
    assert "-c constraints.txt torch==" in runs and "-c constraints.txt ." in runs
    assert "pdserve --help" in runs
