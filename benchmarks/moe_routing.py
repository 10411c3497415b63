"""DeepSeek's grouped routing, per MoE layer, as a decode step's CUDA graph runs it: the torch
ops (`moe.grouped_route(..., fused=False)`, transformers' ~17 kernels) against the one
launch (`kernels.moe_routing.grouped_topk_route`), same run, same device.

    python -m benchmarks.moe_routing [--tokens 1 64 256]

Each variant is captured as LAYERS calls back to back in one CUDA graph (each on its own
logits, as the layers of a step), median of 20 replays, per call; the experts chosen by both
are checked equal first. "x 58 layers": the saving per decode step of the full V3 / R1 (58
MoE layers; V2 has 59).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.kernels import _bench_graph
from pdserve.engine.models.arch import MoEArch
from pdserve.engine.models.moe import grouped_route

LAYERS = 16
ROUTERS = {
    "V3 noaux_tc (256 experts, 8 groups, 4 kept, top 8)": MoEArch(
        num_experts=256, top_k=8, intermediate_size=2048, routing="noaux_tc", num_groups=8, topk_group=4,
        routed_scaling_factor=2.5),
    "V2 group_limited_greedy (160, 8 groups, 3 kept, top 6)": MoEArch(
        num_experts=160, top_k=6, intermediate_size=1536, norm_topk_prob=False, routing="group_limited_greedy",
        num_groups=8, topk_group=3, routed_scaling_factor=16.0),
}


def _case(moe: MoEArch, tokens: int) -> tuple[float, float]:
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    logits = [torch.randn(tokens, moe.num_experts, device="cuda", generator=gen) for _ in range(LAYERS)]
    bias = 0.1 * torch.randn(moe.num_experts, device="cuda", generator=gen) if moe.routing == "noaux_tc" else None
    for x in logits[:2]:
        want = grouped_route(x, moe, bias, fused=False)[1].sort(dim=-1)[0]
        if not torch.equal(grouped_route(x, moe, bias, fused=True)[1].sort(dim=-1)[0], want):
            raise AssertionError(f"{moe.routing} at {tokens} tokens: the kernel chose other experts")
    per_call = []
    for fused in (False, True):
        per_call.append(_bench_graph([lambda x=x, f=fused: grouped_route(x, moe, bias, fused=f) for x in logits]))
    return per_call[0] * 1e3, per_call[1] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256])
    args = parser.parse_args()
    print(f"\nDeepSeek grouped routing per MoE layer, {torch.cuda.get_device_name()}, CUDA graph of {LAYERS} calls")
    print("| router | tokens | torch ops us | kernel us | saved us | x 58 layers, ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, moe in ROUTERS.items():
        for tokens in args.tokens:
            torch_us, kernel_us = _case(moe, tokens)
            saved = torch_us - kernel_us
            print(f"| {name} | {tokens} | {torch_us:.1f} | {kernel_us:.1f} | {saved:.1f} | {saved * 58 / 1e3:.2f} |")


if __name__ == "__main__":
    main()
