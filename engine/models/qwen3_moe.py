"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention (q/k norms), a Mixture-of-Experts
block in the layers `decoder_sparse_step` and `mlp_only_layers` select, a dense MLP in the
others; the top-k weights renormalized when `norm_topk_prob`."""

from __future__ import annotations

from pdserve.engine.models.arch import ModelArch
from pdserve.engine.models.decoder import CausalLM
from pdserve.engine.models.layers import DecoderLayer
from pdserve.engine.models.moe import mlp_of_layer
from pdserve.engine.models.qwen3 import Qwen3Attention
from pdserve.engine.parallel import TensorParallel


class Qwen3MoeForCausalLM(CausalLM):
    @staticmethod
    def make_layer(arch: ModelArch, layer_idx: int, tp: TensorParallel) -> DecoderLayer:
        return DecoderLayer(arch, Qwen3Attention(arch, layer_idx, tp), mlp_of_layer(arch, layer_idx, tp))
