"""A kernel's launches compiled for a GPU that is not here: what a launcher would hand Triton,
recorded instead of run, then compiled for Hopper (Triton compiles to a cubin with its own
ptxas, no driver needed) to read the shared memory the compiler gives each program: the
figure Triton checks at the first launch on the card (issue 53: 417,792 bytes asked of an
H100's 232,448, an OutOfResources on the first prompt).

The kernels must be compiled, not interpreted: the test session runs Triton's interpreter
(tests/conftest.py), so `shared_memory_of` runs this module in a child process with the
interpreter off; `python -m tests.kernels.compiled FAMILY` prints its figures as JSON lines."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HOPPER_SHARED = 232_448  # shared_memory_per_block_optin of an H100 or H200
_ROOT = Path(__file__).resolve().parents[2]


def shared_memory_of(family: str, timeout_s: float = 600, details: bool = False) -> list[dict[str, Any]]:
    """Each launch of `family`'s cases (`CASES`) compiled for Hopper: dicts of case, kernel,
    shared (bytes) and estimate (the launcher's own figure, where it has one); with `details`
    also registers and spill_bytes (ptxas -v: stores plus loads) and mma (the PTX's MMA
    instructions, e.g. "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3")."""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    argv = [sys.executable, "-m", "tests.kernels.compiled", family] + (["--details"] if details else [])
    done = subprocess.run(argv, cwd=_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    if done.returncode:
        raise RuntimeError(f"compiling {family} failed:\n{done.stderr[-4000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


# In the child process ------------------------------------------------------------------


@contextlib.contextmanager
def _recorded() -> Iterator[list[tuple[Any, tuple, dict]]]:
    """Launches recorded instead of run, while inside: (kernel, args, kwargs) each."""
    from triton.runtime.jit import JITFunction

    launches: list[tuple[Any, tuple, dict]] = []
    run = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))

    JITFunction.run = record
    try:
        yield launches
    finally:
        JITFunction.run = run


def _compiled(kernel: Any, args: tuple, kwargs: dict) -> Any:
    """This launch compiled for sm_90 with the specialization (types, alignments, constexprs)
    a launch of the same arguments gets."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    src = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(src, target=target, options=options.__dict__)


def _details(compiled: Any) -> dict[str, Any]:
    """registers and spill_bytes from Triton's own ptxas (-v) on the kernel's PTX, and the
    PTX's distinct MMA instructions."""
    import re
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    ptx = compiled.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        log = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", str(src), "-o", str(src) + ".o"],
                             capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    mma = sorted(set(re.findall(r"\b(wgmma\.mma_async[\w.]*|mma\.sync[\w.]*)", ptx)))
    return {"registers": registers, "spill_bytes": spills, "mma": mma}


def _run(cases: Iterator[tuple[str, Callable[[], Any], int | None]], details: bool) -> None:
    for case, launch, estimate in cases:
        with _recorded() as launches:
            launch()
        for kernel, args, kwargs in launches:
            compiled = _compiled(kernel, args, kwargs)
            row = {"case": case, "kernel": kernel.fn.__name__, "shared": compiled.metadata.shared,
                   "estimate": estimate}
            print(json.dumps(row | (_details(compiled) if details else {})), flush=True)


def main() -> None:
    from tests.kernels import compiled_cases

    _run(getattr(compiled_cases, sys.argv[1])(), details="--details" in sys.argv[2:])


if __name__ == "__main__":
    main()
