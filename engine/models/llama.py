"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) over a paged KV cache.

The model never sees the cache layout: each layer hands q, k, v and the step's rotary
embedding to the step's attention callable, which rotates q and k, writes k, v into the
pool and attends.

As in vLLM, each layer's residual add is fused into the next norm: a layer takes and
returns (x, residual), x being the output of its last block not yet added. On CUDA the
norms (with that add), the rotary embedding with the KV cache write, and SwiGLU's
activation are one Triton kernel each, working in place where they can, a one-row
linear layer (a batch-1 decode step) is `kernels.gemv` and one of 2-8 rows
`kernels.skinny_gemm` (Gluon, on the tensor cores); on the CPU they keep
transformers' torch arithmetic, which the HF parity tests compare greedy tokens against.

Under tensor parallelism (`engine.parallel`) each rank builds the layers of its shard:
its heads, its slice of the MLP and of the vocabulary; o_proj, down_proj and the
embedding end in an all-reduce, the logits in an all-gather. With one rank these are
nn.Linear's own arithmetic, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from pdserve.engine.models.arch import ModelArch
from pdserve.engine.models.rope import Rope, RotaryEmbedding
from pdserve.engine.parallel import Collectives, ShardPlan, TensorParallel
from pdserve.kernels.activation import silu_and_mul
from pdserve.kernels.gemv import gemv
from pdserve.kernels.rms_norm import rms_norm
from pdserve.kernels.skinny_gemm import skinny_gemm, skinny_gemm_supported


class AttentionStep(Protocol):
    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 rope: Rope) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] for this step's tokens, q and k not yet rotated
        -> [T, Hq, D]. It rotates q and k by `rope` (in place or not), writes k, v into the
        layer's cache and attends."""
        ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> a new normalized [T, hidden]."""
        if x.is_cuda:
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


class Linear(nn.Linear):
    """nn.Linear whose few-row products on CUDA read the weights faster than cuBLAS does at
    those shapes: one row (a batch-1 decode step) runs `kernels.gemv`, 2-8 rows (a batch-1
    verification, a draft's catch-up, a small batch's decode step) `kernels.skinny_gemm`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:  # a model's weights are final: both read ahead
            if x.shape[0] == 1:
                return gemv(x, self.weight, self.bias, read_ahead=True)
            if skinny_gemm_supported(x, self.weight):
                return skinny_gemm(x, self.weight, self.bias, read_ahead=True)
        return super().forward(x)


class RowParallelLinear(Linear):
    """A linear layer whose input dimension is split over the ranks: each multiplies its
    slice, the partial sums are all-reduced, the bias is added once (by rank 0)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.comm: Collectives = tp.comm
        self.adds_bias = tp.plan.rank == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.comm.size == 1:
            return super().forward(x)
        return self.comm.all_reduce(nn.functional.linear(x, self.weight, self.bias if self.adds_bias else None))


class VocabParallelEmbedding(nn.Embedding):
    """An embedding of this rank's slice of the vocabulary: ids outside it look up zeros,
    and the all-reduce puts every row together."""

    def __init__(self, tp: TensorParallel, hidden_size: int) -> None:
        super().__init__(tp.plan.vocab_per_rank, hidden_size)
        self.comm: Collectives = tp.comm
        self.start = tp.plan.vocab_start

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.comm.size == 1:
            return super().forward(input_ids)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        return self.comm.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))


class Attention(nn.Module):
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

    def forward(self, x: torch.Tensor, rope: Rope, attn: AttentionStep) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = attn(self.layer_idx, q, k, v, rope)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, arch: ModelArch, tp: TensorParallel) -> None:
        super().__init__()
        inter = tp.plan.intermediate_size
        self.gate_up_proj = Linear(arch.hidden_size, 2 * inter, bias=arch.mlp_bias)
        self.down_proj = RowParallelLinear(inter, arch.hidden_size, arch.mlp_bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if gate_up.is_cuda:
            return self.down_proj(silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int, tp: TensorParallel) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, layer_idx, tp)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch, tp)

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


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ModelArch, max_positions: int, device: torch.device,
                 tp: TensorParallel | None = None) -> None:
        """tp: this rank's shard and collectives (None: the whole model, one rank)."""
        super().__init__()
        self.arch = arch
        self.tp = tp = tp or TensorParallel.single(arch)
        self.embed_tokens = VocabParallelEmbedding(tp, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i, tp) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = Linear(arch.hidden_size, tp.plan.vocab_per_rank, bias=False)
        self.tie_weights()
        self.rotary = RotaryEmbedding(arch.rope, arch.head_dim, max_positions, device)

    def tie_weights(self) -> None:
        """Share the embedding with the LM head (again after `to_empty`, which unties them)."""
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionStep) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]."""
        x, residual, rope = self.embed_tokens(input_ids), None, self.rotary.at(positions)
        for layer in self.layers:
            x, residual = layer(x, residual, rope, attn)
        if residual is None:  # no layers
            return self.norm(x)
        return self.norm.add_and_norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 (on every rank: the shards' logits are gathered)."""
        logits = self.lm_head(hidden).float()
        if self.tp.comm.size == 1:
            return logits
        return self.tp.comm.all_gather(logits)[:, :self.arch.vocab_size]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors, fusing q/k/v and gate/up on the way and keeping
        this rank's slice of each (every rank reads the whole tensors).

        Raises ValueError naming any missing or unexpected tensor.
        """
        params = dict(self.named_parameters())
        plan = self.tp.plan
        with torch.no_grad():  # vocabulary padding past the last token stays zero
            self.embed_tokens.weight.zero_()
            self.lm_head.weight.zero_()
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            place = _placement(hf_name, self.arch, plan)
            if place is None:
                continue
            if place.name not in params:
                raise ValueError(f"unexpected weight {hf_name!r} (no parameter {place.name!r})")
            param = params[place.name]
            with torch.no_grad():
                dst = param.data if place.rows is None else param.data.narrow(0, *place.rows)
                src = _slice(tensor, place.src)
                if src is None or dst.shape != src.shape:
                    shard = " for this rank's shard" if plan.size > 1 else ""
                    raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(dst.shape)}{shard}")
                dst.copy_(src)
            loaded.add(place.key)
        missing = _expected_keys(self) - loaded
        if missing:
            raise ValueError(f"missing weights: {sorted(missing)[:8]}{' ...' if len(missing) > 8 else ''}")


_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


@dataclass(frozen=True, slots=True)
class _Placement:
    """Where a Hugging Face tensor goes: our parameter, the rows of it (a fused one's part),
    and the slice of the tensor this rank keeps (dim, start, length)."""

    name: str
    rows: tuple[int, int] | None = None
    src: tuple[int, int, int] | None = None

    @property
    def key(self) -> str:
        """What `_expected_keys` calls it: a fused parameter's parts by their first row."""
        return f"{self.name}@{self.rows[0]}" if self.rows is not None and _is_fused(self.name) else self.name


def _placement(hf_name: str, arch: ModelArch, plan: ShardPlan) -> _Placement | None:
    """Map a transformers tensor name to its place in this rank's parameters (None: not ours)."""
    name = hf_name.removeprefix("model.")
    if (name == "lm_head.weight" and arch.tie_word_embeddings) or "rotary_emb" in name:
        return None
    parts = name.split(".")
    d = arch.head_dim
    if len(parts) >= 4 and parts[-2] in _FUSED:
        fused, idx = _FUSED[parts[-2]]
        sizes = _fused_sizes(fused, arch, plan)
        starts = ([plan.rank * plan.num_heads * d, plan.kv_head_start * d, plan.kv_head_start * d]
                  if fused == "qkv_proj" else [plan.rank * plan.intermediate_size] * 2)
        parts[-2] = fused
        return _Placement(".".join(parts), (sum(sizes[:idx]), sizes[idx]), (0, starts[idx], sizes[idx]))
    if plan.size == 1:
        return _Placement(name)
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return _Placement(name, (0, plan.vocab_rows), (0, plan.vocab_start, plan.vocab_rows))
    if name.endswith("o_proj.weight"):
        q = plan.num_heads * d
        return _Placement(name, src=(1, plan.rank * q, q))
    if name.endswith("down_proj.weight"):
        inter = plan.intermediate_size
        return _Placement(name, src=(1, plan.rank * inter, inter))
    return _Placement(name)  # norms, and the row-parallel layers' biases: whole on every rank


def _slice(tensor: torch.Tensor, src: tuple[int, int, int] | None) -> torch.Tensor | None:
    """tensor.narrow(*src), or None where the tensor is too small for it."""
    if src is None:
        return tensor
    dim, start, length = src
    if tensor.dim() <= dim or tensor.shape[dim] < start + length:
        return None
    return tensor.narrow(dim, start, length)


def _fused_sizes(fused: str, arch: ModelArch, plan: ShardPlan) -> list[int]:
    """Rows of each part of a fused parameter on this rank: q, k, v or gate, up."""
    if fused == "qkv_proj":
        q, kv = plan.num_heads * arch.head_dim, plan.num_kv_heads * arch.head_dim
        return [q, kv, kv]
    return [plan.intermediate_size] * 2


def _is_fused(name: str) -> bool:
    return name.split(".")[-2] in ("qkv_proj", "gate_up_proj")


def _expected_keys(model: LlamaForCausalLM) -> set[str]:
    keys: set[str] = set()
    for name, _ in model.named_parameters():
        if _is_fused(name):
            sizes = _fused_sizes(name.split(".")[-2], model.arch, model.tp.plan)
            keys |= {f"{name}@{sum(sizes[:i])}" for i in range(len(sizes))}
        else:
            keys.add(name)
    return keys
