"""Model shapes: read from a Hugging Face config, or named for dummy weights."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding; rope_type 'llama3' uses the four llama3 fields."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {self.rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")


@dataclass(frozen=True, slots=True)
class MoEArch:
    """The Mixture-of-Experts layers of a decoder.

    num_experts, top_k: routed experts, and how many each token goes to (softmax over
        all router logits, then the top k).
    intermediate_size: each routed expert's SwiGLU width.
    norm_topk_prob: the top k weights are renormalized to sum to 1 (Mixtral always is).
    shared_intermediate_size: a shared expert every token also goes through, scaled by a
        sigmoid gate (Qwen2-MoE); 0: none.
    decoder_sparse_step, mlp_only_layers: layer i is MoE when (i + 1) % step == 0 and i is
        not one of mlp_only_layers (the others keep the dense MLP of ModelArch.intermediate_size).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool = True
    shared_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"MoE top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"MoE decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx not in self.mlp_only_layers and (layer_idx + 1) % self.decoder_sparse_step == 0


@dataclass(frozen=True, slots=True)
class ModelArch:
    """A decoder of the Llama lineage: GQA, RoPE, RMSNorm, SwiGLU (dense or Mixture of
    Experts). `model_type` names its family (the registry's key, engine.models.registry)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "llama"
    moe: MoEArch | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

    @property
    def digest(self) -> str:
        """12 hex digits that differ for any two shapes (the KV layout's fingerprint names it)."""
        return hashlib.sha256(repr(self).encode()).hexdigest()[:12]

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelArch:
        """Build from a transformers PretrainedConfig of a family pdserve runs; a field it
        does not implement is a ValueError naming it (never a wrong answer). Which
        model_types are run is the registry's to say (engine.models.registry.arch_of)."""
        model_type = getattr(config, "model_type", None)
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", model_type == "mistral"):
            raise ValueError(f"sliding-window attention ({config.sliding_window}) is not supported")
        layer_types = set(getattr(config, "layer_types", None) or ())
        if layer_types - {"full_attention"}:
            raise ValueError(f"layer_types {sorted(layer_types)} are not supported: only full_attention")
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported: only silu (SwiGLU)")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        eos = config.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        attention_bias = bool(getattr(config, "attention_bias", False))
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            max_position_embeddings=config.max_position_embeddings,
            rms_norm_eps=config.rms_norm_eps,
            rope=_rope_from_hf(config),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=attention_bias or model_type == "qwen2" or bool(getattr(config, "qkv_bias", False)),
            o_bias=attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            eos_token_ids=eos_ids,
            model_type=str(model_type),
            moe=_moe_from_hf(config, model_type),
        )


def _moe_from_hf(config: Any, model_type: str | None) -> MoEArch | None:
    if model_type == "mixtral":
        return MoEArch(num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
                       intermediate_size=config.intermediate_size, norm_topk_prob=True)
    if model_type in ("qwen3_moe", "qwen2_moe"):
        if not config.num_experts:
            return None
        return MoEArch(num_experts=config.num_experts, top_k=config.num_experts_per_tok,
                       intermediate_size=config.moe_intermediate_size, norm_topk_prob=bool(config.norm_topk_prob),
                       shared_intermediate_size=getattr(config, "shared_expert_intermediate_size", 0) or 0,
                       decoder_sparse_step=config.decoder_sparse_step or 1,
                       mlp_only_layers=tuple(getattr(config, "mlp_only_layers", None) or ()))
    return None


def _rope_from_hf(config: Any) -> RopeConfig:
    # transformers 5 keeps everything in `rope_parameters`; older configs use
    # `rope_theta` plus an optional `rope_scaling` dict.
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    theta = params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
    rope_type = params.get("rope_type", params.get("type", "default"))
    fields = {k: params[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                     "original_max_position_embeddings") if params.get(k) is not None}
    return RopeConfig(theta=float(theta), rope_type=rope_type, **fields)


_LLAMA3_ROPE = RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0,
                          low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)

DUMMY_SHAPES: dict[str, ModelArch] = {
    "llama-3.1-8b": ModelArch(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, max_position_embeddings=131072, rope=_LLAMA3_ROPE,
        eos_token_ids=(128001, 128008, 128009),
    ),
    "llama-3.2-1b": ModelArch(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
        num_kv_heads=8, head_dim=64, max_position_embeddings=131072,
        rope=RopeConfig(theta=500000.0, rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                        high_freq_factor=4.0, original_max_position_embeddings=8192),
        tie_word_embeddings=True, eos_token_ids=(128001, 128008, 128009),
    ),
    "qwen3-8b": ModelArch(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
        num_kv_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope=RopeConfig(theta=1000000.0), eos_token_ids=(151645, 151643), model_type="qwen3",
    ),
    "qwen3-30b-a3b": ModelArch(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48, num_heads=32,
        num_kv_heads=4, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope=RopeConfig(theta=1000000.0), eos_token_ids=(151645, 151643), model_type="qwen3_moe",
        moe=MoEArch(num_experts=128, top_k=8, intermediate_size=768, norm_topk_prob=True),
    ),
    "mixtral-8x7b": ModelArch(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, max_position_embeddings=32768, rope=RopeConfig(theta=1000000.0),
        eos_token_ids=(2,), model_type="mixtral",
        moe=MoEArch(num_experts=8, top_k=2, intermediate_size=14336, norm_topk_prob=True),
    ),
    "tiny-moe": ModelArch(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, max_position_embeddings=2048, rope=RopeConfig(theta=10000.0),
        tie_word_embeddings=True, eos_token_ids=(0,), model_type="qwen3_moe",
        moe=MoEArch(num_experts=8, top_k=2, intermediate_size=32, norm_topk_prob=True),
    ),
    "tiny": ModelArch(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, max_position_embeddings=2048, rope=RopeConfig(theta=10000.0),
        tie_word_embeddings=True, eos_token_ids=(0,),
    ),
}
