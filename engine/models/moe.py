"""The Mixture-of-Experts block (Mixtral, Qwen3-MoE, Qwen2-MoE): a router picks each
token's top-k experts, each a SwiGLU MLP, whose outputs are summed with the router's
weights; Qwen2-MoE adds a shared expert every token goes through, scaled by a sigmoid gate.

Experts are held as two stacked tensors, `w13` [experts, 2 x intermediate, hidden] (gate
rows, then up rows: Hugging Face's fused `gate_up_proj` layout) and `w2` [experts, hidden,
intermediate]. Under tensor parallelism every rank holds every expert's slice of the
intermediate dimension (as the dense MLP); with expert parallelism (ParallelConfig.
enable_expert_parallel) each rank holds whole experts, `num_experts / ranks` of them.
Attention stays tensor-parallel either way, so every rank has every token: each computes
its experts' (or slices') contributions for the tokens routed to them and one all-reduce
sums them, the shared expert's partial sums included.

FP8 experts (`FusedExperts.use_fp8`) hold w13 and w2 as e4m3 with float32 scales per output
channel (`w13_scale` [E, 2I, 1], `w2_scale` [E, H, 1]) or per 128 x 128 block: the fused
kernel reads them as they are, the CPU path dequantizes them to float32 per call (as
`fp8.linear` does).
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.models import fp8
from pdserve.engine.models.arch import ModelArch, MoEArch
from pdserve.engine.models.layers import MLP, Linear
from pdserve.engine.models.parallel import Collectives, TensorParallel
from pdserve.kernels.fused_moe import fused_moe
from pdserve.kernels.moe_routing import grouped_topk_route, topk_route


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, experts] logits -> (weights [T, k] float32, expert ids [T, k] int64): softmax over
    every expert in float32, the k largest, renormalized to sum to 1 when asked. On a GPU
    one Triton launch (`topk_route`) does it all."""
    if router_logits.is_cuda:
        return topk_route(router_logits, top_k, renormalize)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_route(router_logits: torch.Tensor, moe: MoEArch, correction_bias: torch.Tensor | None = None,
                  fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's routings (`MoEArch.routing`), transformers' arithmetic: [T, experts] float32
    logits -> (weights [T, k] float32, expert ids [T, k] int64), times routed_scaling_factor.

    "softmax" (V2's "greedy"): softmax, the top k (renormalized when norm_topk_prob).
    "group_limited_greedy" (V2): softmax; only the topk_group groups whose best expert
    scores highest are candidates. "noaux_tc" (V3): sigmoid scores; experts are chosen by
    score + `correction_bias` (its load balancing: the choice only, never the weights) within
    the topk_group groups whose two best biased scores sum highest; the weights are the chosen
    experts' plain scores, renormalized when norm_topk_prob.

    `fused` (default: on CUDA) runs the grouped routings as one Triton launch
    (`grouped_topk_route`, the lowest id among equal scores); the torch ops below are the
    CPU path and its reference."""
    if moe.routing == "softmax":
        weights, ids = route(router_logits, moe.top_k, moe.norm_topk_prob)
        return weights * moe.routed_scaling_factor, ids
    if router_logits.is_cuda if fused is None else fused:
        return grouped_topk_route(router_logits, moe.routing, moe.top_k, moe.num_groups, moe.topk_group,
                                  moe.norm_topk_prob, moe.routed_scaling_factor, correction_bias)
    sigmoid = moe.routing == "noaux_tc"
    scores = router_logits.sigmoid() if sigmoid else router_logits.softmax(dim=-1, dtype=torch.float32)
    choice = scores + correction_bias if sigmoid and correction_bias is not None else scores
    grouped = choice.view(-1, moe.num_groups, moe.num_experts // moe.num_groups)
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1) if sigmoid else grouped.max(dim=-1).values
    group_ids = torch.topk(group_scores, k=moe.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_ids, 1).bool()
    expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape_as(choice)
    choice = choice.masked_fill(~expert_mask, float("-inf") if sigmoid else 0.0)
    ids = torch.topk(choice, k=moe.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling_factor, ids


def experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor, first_expert: int = 0) -> torch.Tensor:
    """sum over k of weights[t, k] * expert_{ids[t, k]}(x[t]) for the experts this rank holds
    (ids first_expert .. first_expert + len(w13) - 1; others contribute nothing).

    x: [T, H]; w13: [E, 2I, H]; w2: [E, H, I]; weights: [T, k] (cast to x's dtype, as
    transformers does); ids: [T, k]. Returns [T, H] in x's dtype. The experts run in
    ascending order, each over the tokens routed to it (transformers' loop, the CPU path
    and the fused kernel's reference)."""
    out = torch.zeros_like(x)
    weights = weights.to(x.dtype)
    local = ids - first_expert
    for e in torch.unique(local).tolist():
        if not 0 <= e < w13.shape[0]:
            continue
        token_idx, slot = torch.where(local == e)
        h = nn.functional.linear(x[token_idx], w13[e])
        gate, up = h.chunk(2, dim=-1)
        y = nn.functional.linear(nn.functional.silu(gate) * up, w2[e])
        out.index_add_(0, token_idx, y * weights[token_idx, slot, None])
    return out


class FusedExperts(nn.Module):
    """This rank's experts (or slices of every expert) as two stacked weight tensors."""

    def __init__(self, num_local_experts: int, hidden_size: int, intermediate_size: int, first_expert: int) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(num_local_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_local_experts, hidden_size, intermediate_size))
        self.register_parameter("w13_scale", None)  # set by use_fp8
        self.register_parameter("w2_scale", None)
        self.first_expert = first_expert
        self.fp8_blocked = False

    def use_fp8(self, blocked: bool) -> None:
        """Hold w13 and w2 in FP8 with a scale per output channel, or per 128 x 128 block when
        `blocked`. Before loading: the new parameters are empty, the checkpoint's to fill."""
        for name in ("w13", "w2"):
            w = getattr(self, name)
            e, n, k = w.shape
            shape = (e, -(-n // fp8.SCALE_BLOCK), -(-k // fp8.SCALE_BLOCK)) if blocked else (e, n, 1)
            setattr(self, name, nn.Parameter(torch.empty(w.shape, dtype=fp8.FP8, device=w.device),
                                             requires_grad=False))
            setattr(self, f"{name}_scale", nn.Parameter(torch.empty(shape, dtype=torch.float32, device=w.device),
                                                        requires_grad=False))
        self.fp8_blocked = blocked

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:  # the fused Triton kernel: no host sync, a CUDA graph can hold it
            return fused_moe(x, self.w13, self.w2, weights, ids, self.first_expert, w13_scale=self.w13_scale,
                             w2_scale=self.w2_scale, blocked=self.fp8_blocked)
        w13, w2 = self.w13, self.w2
        if self.w13_scale is not None:
            w13 = fp8.dequantize(w13, self.w13_scale, self.fp8_blocked).to(x.dtype)
            w2 = fp8.dequantize(w2, self.w2_scale, self.fp8_blocked).to(x.dtype)
        return experts_reference(x, w13, w2, weights, ids, self.first_expert)


class SparseMoE(nn.Module):
    """Router, experts and the optional shared expert of one layer; [T, H] -> [T, H]."""

    def __init__(self, arch: ModelArch, tp: TensorParallel) -> None:
        super().__init__()
        moe = arch.moe
        assert moe is not None
        plan = tp.plan
        self.moe: MoEArch = moe
        self.comm: Collectives = tp.comm
        self.gate = Linear(arch.hidden_size, moe.num_experts, bias=False)  # the router, whole on every rank
        self.experts = FusedExperts(plan.num_local_experts, arch.hidden_size, plan.expert_intermediate_size,
                                    plan.first_expert)
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: Linear | None = None
        if moe.shared_intermediate_size:
            self.shared_expert = MLP(arch.hidden_size, plan.shared_intermediate_size, False, tp, reduce=False)
            self.shared_expert_gate = Linear(arch.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.moe.top_k, self.moe.norm_topk_prob)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            assert self.shared_expert_gate is not None
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.comm.all_reduce(out) if self.comm.size > 1 else out


def mlp_of_layer(arch: ModelArch, layer_idx: int, tp: TensorParallel) -> nn.Module:
    """Layer `layer_idx`'s MLP: the MoE block where `arch.moe` says so, else the dense one."""
    if arch.moe is not None and arch.moe.is_moe_layer(layer_idx):
        return SparseMoE(arch, tp)
    return MLP(arch.hidden_size, tp.plan.intermediate_size, arch.mlp_bias, tp)
