"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v bias), a Mixture-of-
Experts block with a shared expert (every token, scaled by a sigmoid gate) in the layers
`decoder_sparse_step` and `mlp_only_layers` select, a dense MLP in the others."""

from __future__ import annotations

from pdserve.engine.models.arch import ModelArch
from pdserve.engine.models.decoder import CausalLM
from pdserve.engine.models.layers import Attention, DecoderLayer
from pdserve.engine.models.moe import mlp_of_layer
from pdserve.engine.parallel import TensorParallel


class Qwen2MoeForCausalLM(CausalLM):
    @staticmethod
    def make_layer(arch: ModelArch, layer_idx: int, tp: TensorParallel) -> DecoderLayer:
        return DecoderLayer(arch, Attention(arch, layer_idx, tp), mlp_of_layer(arch, layer_idx, tp))
