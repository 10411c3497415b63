"""Model shapes: read from a Hugging Face config, or named for dummy weights."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
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
class ModelArch:
    """A Llama-family decoder: GQA, RoPE, RMSNorm, SwiGLU."""

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

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

    @property
    def num_params(self) -> int:
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp + 2 * self.hidden_size) + embed + self.hidden_size

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelArch:
        """Build from a transformers PretrainedConfig; refuses what we do not implement."""
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", model_type == "mistral"):
            raise ValueError(f"sliding-window attention ({config.sliding_window}) is not supported")
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
            qkv_bias=attention_bias or model_type == "qwen2",
            o_bias=attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            eos_token_ids=eos_ids,
        )


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
    "tiny": ModelArch(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, max_position_embeddings=2048, rope=RopeConfig(theta=10000.0),
        tie_word_embeddings=True, eos_token_ids=(0,),
    ),
}
