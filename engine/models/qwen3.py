"""Qwen3 and Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Llama's layer with each query and key
head RMS-normalized before the rotary embedding (`q_norm`, `k_norm`, one weight of head_dim
each, shared by the heads); Qwen3-MoE's Mixture-of-Experts block in the layers
`decoder_sparse_step` and `mlp_only_layers` select (moe.py)."""

from __future__ import annotations

from pdserve.engine.models.arch import ModelArch
from pdserve.engine.models.decoder import CausalLM
from pdserve.engine.models.layers import Attention, DecoderLayer, HeadNorm, RMSNorm
from pdserve.engine.models.moe import mlp_of_layer
from pdserve.engine.models.parallel import TensorParallel


class Qwen3Attention(Attention):
    def __init__(self, arch: ModelArch, layer_idx: int, tp: TensorParallel) -> None:
        super().__init__(arch, layer_idx, tp)
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
        self.head_norm = HeadNorm(self.q_norm, self.k_norm)


class Qwen3ForCausalLM(CausalLM):
    @staticmethod
    def make_layer(arch: ModelArch, layer_idx: int, tp: TensorParallel) -> DecoderLayer:
        return DecoderLayer(arch, Qwen3Attention(arch, layer_idx, tp), mlp_of_layer(arch, layer_idx, tp))
