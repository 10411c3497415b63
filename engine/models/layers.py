"""The layers every model file is built from: norms, (parallel) linear layers, the
vocabulary-parallel embedding, GQA attention over the step's attention callable, the
SwiGLU MLP, and the pre-norm decoder layer around an attention and an MLP.

As in vLLM, each layer's residual add is fused into the next norm: a decoder layer takes
and returns (x, residual), x being the output of its last block not yet added. On CUDA
the norms (with that add), the rotary embedding with the KV cache write, and SwiGLU's
activation are one Triton kernel each, working in place where they can, a one-row linear
layer (a batch-1 decode step) is `kernels.gemv` and one of 2-8 rows `kernels.skinny_gemm`
(Gluon, on the tensor cores); on the CPU they keep transformers' torch arithmetic, which
the HF parity tests compare greedy tokens against.

Under tensor parallelism (`engine.parallel`) each rank builds the layers of its shard:
its heads, its slice of the MLP and of the vocabulary; o_proj, down_proj and the
embedding end in an all-reduce. With one rank these are nn.Linear's own arithmetic, bit
for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from pdserve.engine.models import fp8
from pdserve.engine.models.arch import ModelArch
from pdserve.engine.models.cpu_linear import PackedWeight, cpu_packed_bf16
from pdserve.engine.models.parallel import Collectives, TensorParallel
from pdserve.engine.models.rope import Rope
from pdserve.kernels.activation import silu_and_mul
from pdserve.kernels.fp8_gemm import FP8, SCALE_BLOCK
from pdserve.kernels.gemv import gemv
from pdserve.kernels.rms_norm import rms_norm
from pdserve.kernels.skinny_gemm import skinny_gemm, skinny_gemm_supported


class AttentionStep(Protocol):
    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 rope: Rope, head_norm: HeadNorm | None = None) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] for this step's tokens, q and k not yet rotated
        -> [T, Hq, D]. It normalizes q's and k's heads by `head_norm` when given, rotates q
        and k by `rope` (in place or not), writes k, v into the layer's cache and attends."""
        ...

    def mla(self, layer_idx: int, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, rope: Rope,
            projection: MLAProjection) -> torch.Tensor:
        """Multi-head latent attention over an "mla" pool. q: [T, H, qk_nope + qk_rope] (its
        rope part not yet rotated), kv_c: [T, kv_lora_rank] normalized latents, k_pe:
        [T, qk_rope] not yet rotated -> [T, H, v_head_dim]. It rotates q's rope part and
        k_pe by `rope`, writes [kv_c | k_pe] into the layer's latent cache and attends, the
        latents expanded or absorbed through `projection` (engine.models.mla)."""
        ...


@dataclass(frozen=True, slots=True)
class MLAProjection:
    """`kv_b_proj` of this rank's heads: a latent's expansion to per-head keys and values."""

    kv_b: Linear  # [heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]
    num_heads: int
    qk_nope_head_dim: int
    v_head_dim: int

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [N, kv_lora_rank] -> (k_nope [N, heads, qk_nope_head_dim], v [N, heads, v_head_dim])."""
        kv = self.kv_b(latent).view(latent.shape[0], self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
        return kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)

    def absorbed(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [heads, qk_nope_head_dim, kv_lora_rank], W_UV [heads, v_head_dim, kv_lora_rank])
        in `dtype`: q_nope @ W_UK is the query in latent space, o_latent @ W_UV.T the output."""
        w = self.kv_b.weight
        if self.kv_b.weight_scale is not None:
            w = fp8.dequantize(w, self.kv_b.weight_scale, self.kv_b.fp8_blocked)
        w = w.to(dtype).view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, -1)
        return w[:, :self.qk_nope_head_dim], w[:, self.qk_nope_head_dim:]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., dim] -> a new normalized [..., dim]."""
        if x.is_cuda and x.dim() == 2:
            return rms_norm(x, self.weight, self.eps)
        return self._torch_norm(x)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x). On CUDA one kernel that overwrites residual
        with the sum and x with its norm."""
        if x.is_cuda:
            return rms_norm(x, self.weight, self.eps, residual), residual
        residual = residual + x
        return self._torch_norm(residual), residual

    def _torch_norm(self, x: torch.Tensor) -> torch.Tensor:
        # Accumulate in fp32 whatever the model dtype, as transformers does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


@dataclass(frozen=True)
class HeadNorm:
    """Each q and k head RMS-normalized before the rotary embedding, one weight of head_dim
    each shared by the heads (Qwen3's q_norm and k_norm). The attention step applies it: on
    CUDA inside the rotary kernel (`kernels.rotary_cache_write`: four launches a layer fewer),
    elsewhere with the modules' torch arithmetic (`__call__`)."""

    q: RMSNorm
    k: RMSNorm

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D] -> new normalized ones."""
        return self.q._torch_norm(q), self.k._torch_norm(k)

    def kernel_args(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(q weight, k weight, eps): `rotary_cache_write`'s head_norms."""
        assert self.q.eps == self.k.eps, (self.q.eps, self.k.eps)
        return self.q.weight, self.k.weight, self.q.eps


class Linear(nn.Linear):
    """nn.Linear whose few-row products on CUDA read the weights faster than cuBLAS does at
    those shapes: one row (a batch-1 decode step) runs `kernels.gemv`, 2-8 rows (a batch-1
    verification, a draft's catch-up, a small batch's decode step) `kernels.skinny_gemm`.

    Its FP8 variant (`use_fp8`) holds the weight as float8_e4m3fn [N, K] with float32
    `weight_scale` (per output channel [N, 1], or per 128 x 128 block) and multiplies through
    `engine.models.fp8.linear`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.register_parameter("weight_scale", None)  # set by use_fp8
        self.fp8_blocked = False
        self._packed: PackedWeight | None = None  # the CPU bf16 weight in oneDNN's layout

    def use_fp8(self, blocked: bool) -> None:
        """Hold the weight in FP8 with per-channel scales, or per-block ones when `blocked`.
        Before loading: both parameters are new and empty, the checkpoint's to fill."""
        n, k = self.weight.shape
        shape = (-(-n // SCALE_BLOCK), -(-k // SCALE_BLOCK)) if blocked else (n, 1)
        device = self.weight.device
        self.weight = nn.Parameter(torch.empty(n, k, dtype=FP8, device=device), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(shape, dtype=torch.float32, device=device),
                                         requires_grad=False)
        self.fp8_blocked = blocked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_scale is not None:
            return self.fp8_product(x, self.bias)
        if x.is_cuda:  # a model's weights are final: both read ahead
            if x.shape[0] == 1:
                return gemv(x, self.weight, self.bias, read_ahead=True)
            if skinny_gemm_supported(x, self.weight):
                return skinny_gemm(x, self.weight, self.bias, read_ahead=True)
        elif (x.dtype == torch.bfloat16 and self.weight.dtype == torch.bfloat16 and not torch.is_grad_enabled()
              and cpu_packed_bf16()):
            self._packed = PackedWeight.of(self.weight, self._packed)
            return self._packed.linear(x, self.bias)
        return super().forward(x)

    def fp8_product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ the dequantized weight.T (+ bias): an FP8 layer's product."""
        return fp8.linear(x, self.weight, self.weight_scale, bias, self.fp8_blocked)


class RowParallelLinear(Linear):
    """A linear layer whose input dimension is split over the ranks: each multiplies its
    slice, the partial sums are all-reduced (unless `reduce` is off: the caller sums them
    with others first), the bias is added once (by rank 0)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel,
                 reduce: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.comm: Collectives = tp.comm
        self.adds_bias = tp.plan.rank == 0
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.comm.size == 1:
            return super().forward(x)
        bias = self.bias if self.adds_bias else None
        if self.weight_scale is not None:
            partial = self.fp8_product(x, bias)
        else:
            partial = nn.functional.linear(x, self.weight, bias)
        return self.comm.all_reduce(partial) if self.reduce else partial


class VocabParallelEmbedding(nn.Embedding):
    """An embedding of this rank's slice of the vocabulary: ids outside it look up zeros,
    and the all-reduce puts every row together."""

    def __init__(self, tp: TensorParallel, hidden_size: int) -> None:
        super().__init__(tp.plan.vocab_per_rank, hidden_size)
        self.comm: Collectives = tp.comm
        self.start = tp.plan.vocab_start

    def reset_parameters(self) -> None:
        """Nothing: the weights are always loaded (`weights.load_model`, which builds on the
        meta device). nn.Embedding's own init draws normal_, whose meta kernel imports
        torch._dynamo: 1-2 s of every worker's start on these CPUs, for values never used."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.comm.size == 1:
            return super().forward(input_ids)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        return self.comm.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))


class Attention(nn.Module):
    """GQA attention of this rank's heads: fused q/k/v projection, the step's attention
    callable (the heads' norms of a family that has them, rotary, KV cache write,
    attention), row-parallel output projection."""

    def __init__(self, arch: ModelArch, layer_idx: int, tp: TensorParallel) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = tp.plan.num_heads
        self.num_kv_heads = tp.plan.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size = self.num_heads * arch.head_dim
        self.kv_size = self.num_kv_heads * arch.head_dim
        self.qkv_proj = Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias)
        self.o_proj = RowParallelLinear(self.q_size, arch.hidden_size, arch.o_bias, tp)
        self.head_norm: HeadNorm | None = None  # a family that normalizes each head sets it

    def forward(self, x: torch.Tensor, rope: Rope, attn: AttentionStep) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = attn(self.layer_idx, q, k, v, rope, self.head_norm)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up [T, I]: one kernel on CUDA."""
    if gate_up.is_cuda:
        return silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


class MLP(nn.Module):
    """SwiGLU of this rank's slice of `intermediate_size` (already divided by the ranks)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, tp: TensorParallel,
                 reduce: bool = True) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, tp, reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: x + attn(norm(x)), then + mlp(norm(.)), the adds fused into
    the norms (see the module's docstring)."""

    def __init__(self, arch: ModelArch, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope,
                attn: AttentionStep) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (mlp output, residual), the mlp output not yet added to it.

        The first layer gets the embedding as x and no residual: the embedding becomes it.
        """
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.add_and_norm(x, residual)
        x = self.self_attn(x, rope, attn)
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        return self.mlp(x), residual
