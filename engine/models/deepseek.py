"""DeepSeek-V2 (V2, V2-Lite) and DeepSeek-V3 (V3, R1, V3.1, Moonlight): Llama's pre-norm
decoder with multi-head latent attention (mla.py) and DeepSeekMoE: the first
`first_k_dense_replace` layers dense, the rest a routed Mixture of Experts plus shared
experts every token goes through, with no gate. The router is V2's softmax ("greedy",
"group_limited_greedy") or V3's sigmoid with its `e_score_correction_bias` ("noaux_tc")
(`moe.grouped_route`); as transformers holds it, its weight (and the bias) stay float32 and
its logits are computed in float32 whatever the model's dtype.

A checkpoint's multi-token-prediction layers (`model.layers.{num_hidden_layers}` on, V3's
`num_nextn_predict_layers`) are skipped at load, as transformers skips them, unless the
arch asks for the first (`ModelArch.with_mtp`: the "mtp" drafter), which becomes
`self.mtp` (mtp.py; its copies of the embedding and LM head are dropped: it uses the model's).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pdserve.engine.models.arch import ModelArch, MoEArch
from pdserve.engine.models.decoder import CausalLM
from pdserve.engine.models.layers import MLP, DecoderLayer
from pdserve.engine.models.mla import MLAAttention
from pdserve.engine.models.moe import FusedExperts, grouped_route
from pdserve.engine.models.mtp import MTPLayer
from pdserve.engine.models.parallel import Collectives, TensorParallel
from pdserve.kernels.gemv import gemv

_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")


class DeepseekRouter(nn.Module):
    """The gate: float32 router weights [experts, hidden], and V3's correction bias [experts]."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        moe = arch.moe
        assert moe is not None
        self.moe: MoEArch = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, arch.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias: nn.Parameter | None = None
        if moe.routing == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.empty(moe.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] float32, expert ids [T, k]). One row on CUDA (a
        batch-1 decode step): one `kernels.gemv` launch, x widened as it is read; the routing
        one more (`moe.grouped_route`; `fused` as there: on CUDA by default)."""
        if x.is_cuda and x.shape[0] == 1:
            logits = gemv(x, self.weight, read_ahead=True, out_dtype=torch.float32)
        else:
            logits = nn.functional.linear(x.float(), self.weight)
        return grouped_route(logits, self.moe, self.e_score_correction_bias, fused)


class DeepseekMoE(nn.Module):
    """Router, this rank's routed experts (or slices of them) and its slice of the shared
    experts (one SwiGLU of their summed width); one all-reduce sums the ranks' parts."""

    def __init__(self, arch: ModelArch, tp: TensorParallel) -> None:
        super().__init__()
        moe, plan = arch.moe, tp.plan
        assert moe is not None
        self.comm: Collectives = tp.comm
        self.gate = DeepseekRouter(arch)
        self.experts = FusedExperts(plan.num_local_experts, arch.hidden_size, plan.expert_intermediate_size,
                                    plan.first_expert)
        self.shared_experts: MLP | None = None
        if moe.shared_intermediate_size:
            self.shared_experts = MLP(arch.hidden_size, plan.shared_intermediate_size, False, tp, reduce=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.comm.all_reduce(out) if self.comm.size > 1 else out


class DeepseekForCausalLM(CausalLM):
    def __init__(self, arch: ModelArch, max_positions: int, device: torch.device,
                 tp: TensorParallel | None = None) -> None:
        super().__init__(arch, max_positions, device, tp)
        if arch.mtp:
            self.mtp = MTPLayer(arch, self.make_layer(arch, arch.num_layers, self.tp))

    @staticmethod
    def make_layer(arch: ModelArch, layer_idx: int, tp: TensorParallel) -> DecoderLayer:
        assert arch.moe is not None
        mlp: nn.Module
        if arch.moe.is_moe_layer(layer_idx):
            mlp = DeepseekMoE(arch, tp)
        else:
            mlp = MLP(arch.hidden_size, tp.plan.intermediate_size, False, tp)
        return DecoderLayer(arch, MLAAttention(arch, layer_idx, tp), mlp)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        try:
            super().load_weights(_mtp_renamed(weights, self.arch.num_layers, self.arch.mtp))
        except ValueError as e:
            if self.arch.mtp and "'mtp." in str(e):
                raise ValueError(f"speculative method 'mtp': the checkpoint's MTP layer "
                                 f"(model.layers.{self.arch.num_layers}.*) is missing or incomplete: {e}") from e
            raise
        for module in self.modules():
            if isinstance(module, MLAAttention):
                module.deinterleave_rope_rows()


def _mtp_renamed(weights: Iterable[tuple[str, torch.Tensor]], num_layers: int,
                 mtp: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The decoder's tensors, and with `mtp` the first MTP layer's under `mtp.` (its own
    norms and projection as they are, its decoder layer's under `mtp.layer.`); the other MTP
    layers, and the MTP layer's copies of the embedding and LM head, dropped."""
    for name, tensor in weights:
        match = _LAYER.match(name)
        if match is None or int(match.group(1)) < num_layers:
            yield name, tensor
        elif mtp and int(match.group(1)) == num_layers:
            rest = name[match.end():]
            if rest.startswith(_MTP_OWN):
                yield f"mtp.{rest}", tensor
            elif not rest.startswith(_MTP_SHARED):
                yield f"mtp.layer.{rest}", tensor


_MTP_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
_MTP_SHARED = ("embed_tokens.", "shared_head.head.")
