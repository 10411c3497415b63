"""Mixtral: Llama's attention, a Mixture-of-Experts block in every layer (top-k of the
softmax, renormalized). Its checkpoints name the block `block_sparse_moe` and the experts'
projections w1 (gate), w3 (up), w2 (down): loading.normalize renames them."""

from __future__ import annotations

from pdserve.engine.models.arch import ModelArch
from pdserve.engine.models.decoder import CausalLM
from pdserve.engine.models.layers import Attention, DecoderLayer
from pdserve.engine.models.moe import SparseMoE
from pdserve.engine.parallel import TensorParallel


class MixtralForCausalLM(CausalLM):
    @staticmethod
    def make_layer(arch: ModelArch, layer_idx: int, tp: TensorParallel) -> DecoderLayer:
        return DecoderLayer(arch, Attention(arch, layer_idx, tp), SparseMoE(arch, tp))
