"""How many KV blocks fit a device's memory budget, a draft model's share included."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from pdserve.engine.config import MAX_SPECULATIVE_TOKENS, EngineConfig
from pdserve.engine.kv.pool import KVLayout
from pdserve.engine.models.arch import ModelArch
from pdserve.engine.models.registry import param_counts
from pdserve.engine.models.weights import resolve_model


@dataclass(frozen=True, slots=True)
class DraftMemory:
    """What a draft model of `config.spec` adds beside the target: its weights, and KV
    bytes per block (a draft block for every target block, see `ModelDrafter`)."""

    weight_bytes: int = 0
    kv_bytes_per_block: int = 0


def draft_memory(config: EngineConfig, target: ModelArch) -> DraftMemory:
    spec = config.spec
    if not spec.enabled or spec.method not in ("draft_model", "self_draft"):
        return DraftMemory()
    dtype = config.model.torch_dtype()
    itemsize = config.cache.kv_dtype(dtype).itemsize
    if spec.method == "self_draft":  # the target's own weights; KV for its first layers
        arch, weight_bytes = target, 0
        num_layers = min(spec.num_draft_layers, target.num_layers)
    else:
        assert spec.draft_model is not None
        arch = resolve_model(dataclasses.replace(config.model, source=spec.draft_model)).arch
        weight_bytes, num_layers = param_counts(arch).total * dtype.itemsize, arch.num_layers
    # A head of listed rows is a copy (of at most the vocabulary's rows when the file sets N); the first N are a view.
    if spec.draft_vocab_file is not None:
        weight_bytes += (spec.draft_vocab_size or arch.vocab_size) * arch.hidden_size * dtype.itemsize
    kv = num_layers * config.cache.block_size * arch.kv_values_per_token * itemsize
    return DraftMemory(weight_bytes, kv)


def blocks_that_fit(config: EngineConfig, layout: KVLayout, device: torch.device,
                    draft: DraftMemory = DraftMemory()) -> int:
    bytes_per_block = layout.bytes_per_block + draft.kv_bytes_per_block
    if device.type == "cuda":
        # What the loader freed (a float weight quantized at load, a tensor stacked into a fused
        # one) sits in torch's cache, which the device counts as used: hand it back first, so
        # the pool is sized from what is really left.
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        reserve = config.cache.activation_reserve_gib * 2**30  # activations and logits of the largest step
        budget = free - (1 - config.cache.gpu_memory_utilization) * total - reserve - draft.weight_bytes
        # The draft's KV also holds the drafted tail of every running sequence.
        tail_blocks = config.scheduler.max_num_seqs * -(-MAX_SPECULATIVE_TOKENS // layout.block_size)
        budget -= draft.kv_bytes_per_block * tail_blocks
    else:
        budget = config.cache.cpu_kv_cache_gib * 2**30
    num_blocks = int(budget // bytes_per_block)
    if num_blocks < 1:
        raise ValueError("no memory left for the KV cache; lower the model size or raise the memory budget")
    return num_blocks
