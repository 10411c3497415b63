"""Model shapes: read from a Hugging Face config, or named for dummy weights."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "yarn")
ROUTINGS = ("softmax", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding; rope_type 'llama3' uses the four llama3 fields, 'yarn' factor,
    original_max_position_embeddings, beta_fast/beta_slow, mscale/mscale_all_dim (or an
    explicit attention_factor) and truncate, as transformers' `_compute_yarn_parameters`."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {self.rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")

    @property
    def cos_sin_scale(self) -> float:
        """What YaRN multiplies cos and sin by (1 for the other types)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    @property
    def softmax_scale_factor(self) -> float:
        """YaRN's `mscale_all_dim` folded into the softmax scale (mscale squared), as MLA models
        do (transformers' `yarn_apply_mscale`); 1 otherwise."""
        if self.rope_type == "default" or not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's Eq. 21: 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True, slots=True)
class MLAArch:
    """Multi-head latent attention (DeepSeek-V2/V3): a token's KV is one latent of
    kv_lora_rank values (after `kv_a_layernorm`) plus a rotated key part of qk_rope_head_dim
    shared by the heads; `kv_b_proj` expands the latent to each head's no-rope key
    (qk_nope_head_dim) and value (v_head_dim). Queries come from `q_proj`, or through a
    q_lora_rank bottleneck (`q_a_proj`, `q_a_layernorm`, `q_b_proj`) when it is set.
    rope_interleave: the rotary pairs are (x0, x1), (x2, x3), ... (DeepSeek's checkpoints;
    transformers' V3 `rope_interleave`, V2 always), else the two halves (Llama's)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_interleave: bool = True

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"MLA {name} must be >= 1, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"MLA qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """One token's cache entry: the latent, then the rotated key part (V3: 512 + 64)."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class MoEArch:
    """The Mixture-of-Experts layers of a decoder.

    num_experts, top_k: routed experts, and how many each token goes to (softmax over
        all router logits, then the top k).
    intermediate_size: each routed expert's SwiGLU width.
    norm_topk_prob: the top k weights are renormalized to sum to 1 (Mixtral always is).
    shared_intermediate_size: a shared expert every token also goes through, scaled by a
        sigmoid gate (Qwen2-MoE) or not (`shared_gate` off: DeepSeek's shared experts, their
        widths summed); 0: none.
    decoder_sparse_step, mlp_only_layers, first_dense_layers: layer i is MoE when
        (i + 1) % step == 0, i is not one of mlp_only_layers and i >= first_dense_layers
        (the others keep the dense MLP of ModelArch.intermediate_size).
    routing: "softmax" (softmax over every expert, the top k: DeepSeek-V2's "greedy" too),
        "group_limited_greedy" (DeepSeek-V2: softmax, the top k within the topk_group groups
        of num_groups whose best expert scores highest), "noaux_tc" (DeepSeek-V3: sigmoid
        scores; the choice by scores + the gate's `e_score_correction_bias` within the
        topk_group groups whose two best score highest; the weights the chosen scores).
    routed_scaling_factor: the routed experts' weights are multiplied by it (DeepSeek).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool = True
    shared_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_gate: bool = True
    first_dense_layers: int = 0
    routing: str = "softmax"
    num_groups: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"MoE top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"MoE decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"MoE routing must be one of {ROUTINGS}, got {self.routing!r}")
        if self.routing != "softmax":
            if self.num_groups < 1 or self.num_experts % self.num_groups:
                raise ValueError(f"MoE n_group {self.num_groups} must divide the {self.num_experts} experts")
            if not 1 <= self.topk_group <= self.num_groups:
                raise ValueError(f"MoE topk_group must be in [1, n_group={self.num_groups}], got {self.topk_group}")
            if self.top_k > self.topk_group * self.num_experts // self.num_groups:
                raise ValueError(f"MoE top_k {self.top_k} exceeds the experts of topk_group {self.topk_group} groups")

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (layer_idx >= self.first_dense_layers and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)


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
    mla: MLAArch | None = None  # multi-head latent attention (head_dim is then its rotary part's)
    # Multi-token prediction (DeepSeek-V3): the layers the checkpoint ships after its decoder
    # (`num_nextn_predict_layers`, as `model.layers.{num_layers}.*`), and whether the model
    # is built with the first of them (`with_mtp`: speculation asked for it) or skips them.
    num_mtp_layers: int = 0
    mtp: bool = False

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

    @property
    def softmax_scale(self) -> float:
        """The attention's softmax scale: 1 / sqrt(the query/key width), times YaRN's
        mscale_all_dim factor under MLA."""
        if self.mla is None:
            return self.head_dim ** -0.5
        return self.mla.qk_head_dim ** -0.5 * self.rope.softmax_scale_factor

    @property
    def kv_values_per_token(self) -> int:
        """Values one token's KV takes in one layer (the whole model's heads)."""
        return self.mla.latent_dim if self.mla is not None else 2 * self.num_kv_heads * self.head_dim

    def with_layers(self, num_layers: int) -> ModelArch:
        """The same shape with `num_layers` layers (its first dense layers kept: a MoE model
        of fewer layers keeps them and then MoE layers)."""
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        return dataclasses.replace(self, num_layers=num_layers)

    def with_mtp(self) -> ModelArch:
        """The same model built with its first multi-token-prediction layer (a drafter,
        `SpecConfig.method` "mtp"); ValueError naming why a model has none."""
        if self.mla is None or self.moe is None:
            raise ValueError(f"speculative method 'mtp' needs a DeepSeek-V3-style checkpoint with multi-token-"
                             f"prediction layers; a {self.model_type} model has none")
        if self.num_mtp_layers < 1:
            raise ValueError(f"speculative method 'mtp': this {self.model_type} checkpoint has no multi-token-"
                             f"prediction layers (num_nextn_predict_layers is 0; they would be "
                             f"model.layers.{self.num_layers}.*)")
        return dataclasses.replace(self, mtp=True)

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
        mla = _mla_from_hf(config, model_type)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if mla is not None:
            head_dim = mla.qk_rope_head_dim  # the rotary tables' width (transformers' head_dim too)
        eos = config.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        attention_bias = bool(getattr(config, "attention_bias", False))
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            # MLA expands the latent to every query head's K and V: no KV head grouping
            num_kv_heads=(config.num_attention_heads if mla is not None
                          else getattr(config, "num_key_value_heads", None) or config.num_attention_heads),
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
            mla=mla,
            num_mtp_layers=int(getattr(config, "num_nextn_predict_layers", 0) or 0) if mla is not None else 0,
        )


DEEPSEEK_ROUTING = {"deepseek_v2": {"greedy": "softmax", "group_limited_greedy": "group_limited_greedy"},
                    "deepseek_v3": {"noaux_tc": "noaux_tc"}}
DEEPSEEK_SCORING = {"deepseek_v2": "softmax", "deepseek_v3": "sigmoid"}


def _mla_from_hf(config: Any, model_type: str | None) -> MLAArch | None:
    if model_type not in DEEPSEEK_ROUTING:
        return None
    for name in ("attention_bias", "mlp_bias"):
        if getattr(config, name, False):
            raise ValueError(f"{name} is not supported for {model_type}")
    return MLAArch(kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_nope_head_dim,
                   qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim,
                   q_lora_rank=config.q_lora_rank or None,
                   # transformers' V2 always rotates interleaved pairs (complex products)
                   rope_interleave=model_type == "deepseek_v2" or bool(getattr(config, "rope_interleave", True)))


def _deepseek_moe(config: Any, model_type: str) -> MoEArch:
    """DeepSeekMoE: shared experts without a gate, the first `first_k_dense_replace` layers
    dense, V2's "greedy" / "group_limited_greedy" or V3's "noaux_tc" routing; a routing,
    scoring or layer pattern transformers would not run as the checkpoint says is refused."""
    routings = DEEPSEEK_ROUTING[model_type]
    method = getattr(config, "topk_method", None) or next(iter(routings))
    if method not in routings:
        raise ValueError(f"topk_method {method!r} is not supported for {model_type}; supported: {sorted(routings)}")
    scoring = getattr(config, "scoring_func", None) or DEEPSEEK_SCORING[model_type]
    if scoring != DEEPSEEK_SCORING[model_type]:
        raise ValueError(f"scoring_func {scoring!r} is not supported for {model_type}; "
                         f"supported: {DEEPSEEK_SCORING[model_type]!r}")
    if (getattr(config, "moe_layer_freq", None) or 1) != 1:
        raise ValueError(f"moe_layer_freq {config.moe_layer_freq} is not supported: only 1 (every layer after "
                         f"first_k_dense_replace is MoE, as transformers builds it)")
    norm = bool(getattr(config, "norm_topk_prob", False))
    if model_type == "deepseek_v2" and norm:
        # transformers' V2 ignores it where DeepSeek's own code renormalizes: no one answer to match
        raise ValueError("norm_topk_prob true is not supported for deepseek_v2")
    if not config.n_routed_experts:
        raise ValueError(f"n_routed_experts {config.n_routed_experts!r} is not supported: {model_type} needs experts")
    grouped = routings[method] != "softmax"
    return MoEArch(num_experts=config.n_routed_experts, top_k=config.num_experts_per_tok,
                   intermediate_size=config.moe_intermediate_size, norm_topk_prob=norm,
                   shared_intermediate_size=config.moe_intermediate_size * (config.n_shared_experts or 0),
                   shared_gate=False, first_dense_layers=config.first_k_dense_replace or 0,
                   routing=routings[method], num_groups=(config.n_group or 1) if grouped else 1,
                   topk_group=(config.topk_group or 1) if grouped else 1,
                   routed_scaling_factor=float(config.routed_scaling_factor))


def _moe_from_hf(config: Any, model_type: str | None) -> MoEArch | None:
    if model_type in DEEPSEEK_ROUTING:
        return _deepseek_moe(config, model_type)
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
    names = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")
    fields = {k: params[k] for k in names if params.get(k) is not None}
    if rope_type == "yarn" and fields.get("factor") is None:  # transformers' default: the context's growth
        fields["factor"] = config.max_position_embeddings / fields["original_max_position_embeddings"]
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
    # DeepSeek-V2-Lite (15.7B, 2.4B active) and DeepSeek-V3 (671B, 37B active), from their
    # config.json files.
    "deepseek-v2-lite": ModelArch(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_layers=27, num_heads=16,
        num_kv_heads=16, head_dim=64, max_position_embeddings=163840, rms_norm_eps=1e-6,
        rope=RopeConfig(theta=10000.0, rope_type="yarn", factor=40.0, original_max_position_embeddings=4096,
                        mscale=0.707, mscale_all_dim=0.707),
        eos_token_ids=(100001,), model_type="deepseek_v2",
        moe=MoEArch(num_experts=64, top_k=6, intermediate_size=1408, norm_topk_prob=False,
                    shared_intermediate_size=2 * 1408, shared_gate=False, first_dense_layers=1),
        mla=MLAArch(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
    ),
    "deepseek-v3": ModelArch(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_layers=61, num_heads=128,
        num_kv_heads=128, head_dim=64, max_position_embeddings=163840, rms_norm_eps=1e-6,
        rope=RopeConfig(theta=10000.0, rope_type="yarn", factor=40.0, original_max_position_embeddings=4096,
                        mscale=1.0, mscale_all_dim=1.0),
        eos_token_ids=(1,), model_type="deepseek_v3",
        moe=MoEArch(num_experts=256, top_k=8, intermediate_size=2048, norm_topk_prob=True,
                    shared_intermediate_size=2048, shared_gate=False, first_dense_layers=3, routing="noaux_tc",
                    num_groups=8, topk_group=4, routed_scaling_factor=2.5),
        mla=MLAArch(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=1536),
        num_mtp_layers=1,
    ),
}


def dummy_shape(spec: str) -> ModelArch:
    """A named dummy shape, `<name>` or `<name>:layers=<N>` (its first N layers: a MoE shape
    keeps its dense first layers, e.g. deepseek-v3:layers=5 is 3 dense + 2 MoE)."""
    name, _, option = spec.partition(":")
    if name not in DUMMY_SHAPES:
        raise ValueError(f"unknown dummy shape {name!r}; known: {sorted(DUMMY_SHAPES)}")
    arch = DUMMY_SHAPES[name]
    if not option:
        return arch
    key, _, value = option.partition("=")
    if key != "layers" or not value.isdigit():
        raise ValueError(f"dummy shape option {option!r}: expected layers=<N>")
    return arch.with_layers(int(value))
