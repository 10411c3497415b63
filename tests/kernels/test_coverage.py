"""Every public function of kernels/ is exercised by a kernel test module."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import tests.kernels
from pdserve import kernels


def _public_functions() -> set[str]:
    names = set()
    for info in pkgutil.iter_modules(kernels.__path__):
        if info.name.startswith("_"):  # a private module's functions serve a public one's
            continue
        module = importlib.import_module(f"pdserve.kernels.{info.name}")
        names |= {name for name, obj in inspect.getmembers(module, inspect.isfunction)
                  if not name.startswith("_") and obj.__module__ == module.__name__}
    return names


def _covered() -> set[str]:
    names = set()
    for info in pkgutil.iter_modules(tests.kernels.__path__):
        if info.name.startswith("test_"):
            names |= set(getattr(importlib.import_module(f"tests.kernels.{info.name}"), "COVERS", ()))
    return names


def test_every_public_kernel_is_tested():
    public = _public_functions()
    assert public, "no public kernel found"
    assert public <= _covered(), public - _covered()
