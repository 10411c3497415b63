"""Llama 2/3, SmolLM2, Mistral (without sliding window), Qwen2/2.5, and the Mixture-of-Experts
families of the same layer, Mixtral and Qwen2-MoE: GQA attention with optional q/k/v bias,
then a SwiGLU MLP or, in the layers `arch.moe` selects, a Mixture-of-Experts block (moe.py;
Qwen2-MoE's shared expert and each family's routing are its config's). The shared blocks
are in layers.py, the skeleton in decoder.py; Mixtral's checkpoint names are loading.py's."""

from __future__ import annotations

from pdserve.engine.models.arch import ModelArch
from pdserve.engine.models.decoder import CausalLM
from pdserve.engine.models.layers import Attention, DecoderLayer
from pdserve.engine.models.moe import mlp_of_layer
from pdserve.engine.models.parallel import TensorParallel


class LlamaForCausalLM(CausalLM):
    @staticmethod
    def make_layer(arch: ModelArch, layer_idx: int, tp: TensorParallel) -> DecoderLayer:
        return DecoderLayer(arch, Attention(arch, layer_idx, tp), mlp_of_layer(arch, layer_idx, tp))
