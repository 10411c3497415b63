"""Our generic top-level names must not confuse transformers.

`kernels` is also a Hugging Face package that transformers probes for (and
would try to load kernels from a hub with); `proto` is proto-plus's import name.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["kernels", "proto", "engine", "cluster"])
def test_our_packages_are_what_imports_find(name):
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        pytest.skip(f"{name} not created yet")
    assert Path(spec.origin).resolve().is_relative_to(ROOT)


def test_transformers_does_not_take_our_kernels_for_hf_kernels():
    from transformers.utils import import_utils

    assert not import_utils.is_kernels_available()


@pytest.mark.slow
def test_transformers_still_loads_a_model(model_folder):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_folder), dtype=torch.float32)
    assert model.config.model_type == "llama"
