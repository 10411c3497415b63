"""Llama 2/3, SmolLM2, Mistral (without sliding window) and Qwen2/2.5: GQA attention with
optional q/k/v bias, SwiGLU MLP. The shared blocks are in layers.py, the skeleton in
decoder.py."""

from __future__ import annotations

from pdserve.engine.models.arch import ModelArch
from pdserve.engine.models.decoder import CausalLM
from pdserve.engine.models.layers import MLP, Attention, DecoderLayer
from pdserve.engine.parallel import TensorParallel


class LlamaForCausalLM(CausalLM):
    @staticmethod
    def make_layer(arch: ModelArch, layer_idx: int, tp: TensorParallel) -> DecoderLayer:
        mlp = MLP(arch.hidden_size, tp.plan.intermediate_size, arch.mlp_bias, tp)
        return DecoderLayer(arch, Attention(arch, layer_idx, tp), mlp)
