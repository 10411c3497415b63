"""A CPU linear layer's bf16 weight held in oneDNN's own blocked layout (as inductor's CPU
freezing and vLLM's CPU backend hold theirs).

`nn.functional.linear` in bf16 on the CPU is a oneDNN (AMX / AVX512-BF16) matmul too, but it
reorders the [N, K] weight into the kernel's layout on every call: at a decode step's few
rows that reorder is about half of each product (SmolLM2's layers at 32 rows: 0.29 ->
0.15 ms for gate_up, the lm_head 4.1 -> 2.3 ms, one thread). Held once in that layout the
product is the same kernel over the same numbers: the outputs are equal bit for bit.

The packed copy follows its weight: it is made again when the weight is replaced or
written in place (its storage or version counter changes), so loading, tying and tests
that edit a weight see their weights. Only without autograd (oneDNN's op has no backward):
the engine's forwards run under inference mode."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@functools.cache
def cpu_packed_bf16() -> bool:
    """Whether this torch's oneDNN runs bf16 linears on this CPU (it needs AVX512 with
    BF16, or AMX; elsewhere bf16 stays on `nn.functional.linear`)."""
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return (torch.backends.mkldnn.is_available() and mkldnn is not None
            and hasattr(mkldnn, "_reorder_linear_weight") and torch.ops.mkldnn._is_mkldnn_bf16_supported())


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A bf16 weight [N, K] reordered for oneDNN, and what it was made from."""

    packed: torch.Tensor  # an opaque mkldnn tensor
    data_ptr: int
    version: int

    @staticmethod
    def of(weight: torch.Tensor, held: PackedWeight | None) -> PackedWeight:
        """`held` while it is `weight`'s current packing, else a new one."""
        version = -1 if weight.is_inference() else weight._version  # an inference tensor keeps no count
        if held is not None and held.data_ptr == weight.data_ptr() and held.version == version:
            return held
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        return PackedWeight(packed, weight.data_ptr(), version)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] @ weight.T (+ bias) -> [..., N], as `nn.functional.linear` computes it."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
