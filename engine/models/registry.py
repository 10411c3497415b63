"""Which class runs which model: Hugging Face's `model_type` -> a CausalLM subclass, and
what is known of a model from its class alone (parameter counts, checkpoint tensors).

To add a family: a line in MODELS when a class here builds its layer (the MoE families
differ from their dense ones only in ModelArch.moe), else one file under engine/models/
with a CausalLM subclass whose `make_layer` builds its layer from layers.py and moe.py, and
its line; what its config adds read in `ModelArch.from_hf_config` (refusing what no file
implements); a dummy shape in arch.py if benchmarks want one.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.engine.models.arch import ModelArch
from pdserve.engine.models.decoder import CausalLM
from pdserve.engine.models.deepseek import DeepseekForCausalLM
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.engine.models.loading import checkpoint_names
from pdserve.engine.models.qwen3 import Qwen3ForCausalLM

MODELS: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "mixtral": LlamaForCausalLM,  # its MoE layers are ModelArch.moe's (moe.py)
    "qwen2_moe": LlamaForCausalLM,
    "qwen3_moe": Qwen3ForCausalLM,
    "deepseek_v2": DeepseekForCausalLM,
    "deepseek_v3": DeepseekForCausalLM,
}


def model_class(arch: ModelArch) -> type[CausalLM]:
    if arch.model_type not in MODELS:
        raise ValueError(f"unsupported model_type {arch.model_type!r}; supported: {sorted(MODELS)}")
    return MODELS[arch.model_type]


def arch_of(hf_config: Any) -> ModelArch:
    """The ModelArch of a transformers config; ValueError naming what pdserve does not run
    (a model_type without a class here, or a field its class does not implement)."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in MODELS:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(MODELS)}")
    return ModelArch.from_hf_config(hf_config)


@dataclass(frozen=True, slots=True)
class ParamCounts:
    """total: every weight (memory, the KV budget); active: the weights one token reads
    (every routed expert's counted top_k / num_experts: speculation's cost model)."""

    total: int
    active: int


@functools.lru_cache(maxsize=32)
def param_counts(arch: ModelArch) -> ParamCounts:
    """Counted from the model's own parameters (built on the meta device: no memory)."""
    model = _meta_model(arch)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    active = total - experts
    if arch.moe is not None:
        active += experts * arch.moe.top_k // arch.moe.num_experts
    return ParamCounts(total, active)


def checkpoint_tensors(arch: ModelArch) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(Hugging Face name, shape) of every tensor a checkpoint of `arch` holds."""
    return checkpoint_names(_meta_model(arch), arch)


def _meta_model(arch: ModelArch) -> CausalLM:
    with torch.device("meta"):
        return model_class(arch)(arch, 1, torch.device("meta"))
