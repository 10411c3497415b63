"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) over a paged KV cache.

The model never sees the cache layout: each layer hands q, k, v to the
step's attention callable, which writes k, v into the pool and attends.

As in vLLM, each layer's residual add is fused into the next norm: a layer takes and
returns (x, residual), x being the output of its last block not yet added. On CUDA the
norms (with that add), the rotary embedding and SwiGLU's activation are one Triton
kernel each, working in place where they can; on the CPU they keep transformers' torch
arithmetic, which the HF parity tests compare greedy tokens against.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
from torch import nn

from pdserve.engine.models.arch import ModelArch
from pdserve.engine.models.rope import RotaryEmbedding
from pdserve.kernels.activation import silu_and_mul
from pdserve.kernels.rms_norm import rms_norm


class AttentionStep(Protocol):
    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] for this step's tokens -> [T, Hq, D]."""
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


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=arch.o_bias)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                attn: AttentionStep) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        out = attn(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=arch.mlp_bias)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=arch.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if gate_up.is_cuda:
            return self.down_proj(silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, layer_idx)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                rotary: RotaryEmbedding, attn: AttentionStep) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (mlp output, residual), the mlp output not yet added to it.

        The first layer gets the embedding as x and no residual: the embedding becomes it.
        """
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.add_and_norm(x, residual)
        x = self.self_attn(x, positions, rotary, attn)
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ModelArch, max_positions: int, device: torch.device) -> None:
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.tie_weights()
        self.rotary = RotaryEmbedding(arch.rope, arch.head_dim, max_positions, device)

    def tie_weights(self) -> None:
        """Share the embedding with the LM head (again after `to_empty`, which unties them)."""
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionStep) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]."""
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, self.rotary, attn)
        if residual is None:  # no layers
            return self.norm(x)
        return self.norm.add_and_norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32."""
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors, fusing q/k/v and gate/up on the way.

        Raises ValueError naming any missing or unexpected tensor.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name, shard = _hf_to_ours(hf_name, self.arch)
            if name is None:
                continue
            if name not in params:
                raise ValueError(f"unexpected weight {hf_name!r} (no parameter {name!r})")
            param = params[name]
            with torch.no_grad():
                dst = param.data if shard is None else param.data.narrow(0, *shard)
                if dst.shape != tensor.shape:
                    raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
                dst.copy_(tensor)
            loaded.add(name if shard is None else f"{name}@{shard[0]}")
        expected = _expected_keys(self)
        missing = expected - loaded
        if missing:
            raise ValueError(f"missing weights: {sorted(missing)[:8]}{' ...' if len(missing) > 8 else ''}")


_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


def _hf_to_ours(hf_name: str, arch: ModelArch) -> tuple[str | None, tuple[int, int] | None]:
    """Map a transformers tensor name to (our parameter, (row offset, rows) of it or None)."""
    name = hf_name.removeprefix("model.")
    if name == "lm_head.weight" and arch.tie_word_embeddings:
        return None, None
    if "rotary_emb" in name:
        return None, None
    parts = name.split(".")
    if len(parts) >= 4 and parts[-2] in _FUSED:
        fused, idx = _FUSED[parts[-2]]
        q, kv, inter = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.intermediate_size
        sizes = [q, kv, kv] if fused == "qkv_proj" else [inter, inter]
        parts[-2] = fused
        return ".".join(parts), (sum(sizes[:idx]), sizes[idx])
    return name, None


def _expected_keys(model: LlamaForCausalLM) -> set[str]:
    arch = model.arch
    keys: set[str] = set()
    for name, param in model.named_parameters():
        if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
            keys |= {f"{name}@0", f"{name}@{q}", f"{name}@{q + kv}"}
        elif name.endswith("gate_up_proj.weight") or name.endswith("gate_up_proj.bias"):
            keys |= {f"{name}@0", f"{name}@{arch.intermediate_size}"}
        else:
            keys.add(name)
    return keys
