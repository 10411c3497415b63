"""What the tiny-model family tests share (test_new_families, test_deepseek): a float32 CPU
engine over a saved folder, and prompts that share a prefix."""

from __future__ import annotations

from pathlib import Path

import torch

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.engine import Engine


def cpu_engine(source: str | Path, **overrides) -> Engine:
    return Engine(EngineConfig(model=ModelConfig(source=str(source), device="cpu", dtype="float32"), **overrides))


def family_prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, 250, (40,), generator=gen).tolist()  # shared: the later prompts hit its blocks
    return [prefix + torch.randint(0, 250, (n,), generator=gen).tolist() for n in (3, 25, 90)] + [[7, 8, 9]]
