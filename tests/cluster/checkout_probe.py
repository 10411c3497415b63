"""Run as a process from the checkout's root (`python -m tests.cluster.checkout_probe`):
start Ray as `pdserve serve` does, and report where a Ray actor, and a process the actor
spawns the way a tensor-parallel rank is spawned, find each top-level folder name of the
checkout. Prints a JSON report for tests/cluster/test_from_checkout.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import ray

from pdserve.cluster.ray_driver import init_ray

ROOT = Path(__file__).resolve().parents[2]

# Runs in the actor and in its child (code, not a function of this module: neither process
# can import tests/, which is the point). Each name maps to the places its spec points at.
FIND = """
import importlib.util, json, sys
found = {}
for name in NAMES:
    spec = importlib.util.find_spec(name)
    found[name] = [] if spec is None else [spec.origin or "", *(spec.submodule_search_locations or [])]
REPORT = {"sys_path": sys.path, "found": found}
"""

CHILD = FIND + """
with open(OUT, "w") as f:
    json.dump(REPORT, f)
"""


def _actor_class():
    """Made here so that Ray ships the class by value."""

    class Probe:
        def find(self, names: list[str]) -> dict:
            scope: dict = {"NAMES": names}
            exec(FIND, scope)
            return scope["REPORT"]

        def find_in_spawned_child(self, names: list[str], out: str) -> dict:
            # The context and process kind engine/runner/tensor_parallel.py starts its ranks with.
            import torch.multiprocessing

            ctx = torch.multiprocessing.get_context("spawn")
            child = ctx.Process(target=exec, args=(CHILD, {"NAMES": names, "OUT": out}), daemon=True)
            child.start()
            child.join(120)
            if child.exitcode != 0:
                raise RuntimeError(f"the spawned child exited with {child.exitcode}")
            with open(out) as f:
                return json.load(f)

    return ray.remote(num_cpus=0)(Probe)


def main() -> dict:
    names = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and p.name.isidentifier())
    init_ray(None, "127.0.0.1", num_cpus=1)
    try:
        probe = _actor_class().remote()
        out = Path(sys.argv[1])
        return {"root": str(ROOT), "names": names,
                "actor": ray.get(probe.find.remote(names), timeout=120),
                "child": ray.get(probe.find_in_spawned_child.remote(names, str(out)), timeout=180)}
    finally:
        ray.shutdown()


if __name__ == "__main__":
    print(json.dumps(main()))
