"""FP8 weights: which checkpoints hold them, online quantization, and the product.

A model with FP8 weights holds the linear layers of its decoder layers (q/k/v, o, gate/up,
down: `LAYERS`; an MoE layer's experts, `moe.FusedExperts`) as
float8_e4m3fn with float32 scales, w = w8 * scale; the embedding, the
norms, the router and the LM head stay in the model's dtype (what vLLM's and SGLang's FP8
methods do: those are small, or sensitive, or both). A layer's scales are one of:
- per output channel, [N, 1]: online quantization (`--quantization fp8`: each row's
  amax / 448, at load) and compressed-tensors' `channel` strategy; a per-tensor scale
  (compressed-tensors' `tensor`, quant_method `fp8` without blocks) is repeated on every
  row of its tensor, which is exact and lets fused q/k/v keep their three scales;
- per 128 x 128 block, [ceil(N/128), ceil(K/128)]: DeepSeek-V3's and Qwen3-FP8's
  `weight_scale_inv`, and compressed-tensors' `block` strategy.

Activations are not quantized from checkpoint scales: a static `input_scale` is checked and
dropped, and the product quantizes x per token where it quantizes at all (cuBLASLt's scaled
matmul, at > 16 rows of per-channel weights), which is at least as accurate as one scale for
every token. Where: the CPU dequantizes the weight to float32 on every call (`linear`)
rather than keeping a float32 copy: the FP8 tensor stays the only copy, 1 byte a weight as on
the GPU, and the CPU path exists for correctness, not speed. On CUDA, one row (a batch-1
decode step) runs `kernels.gemv` (its FP8 weights widened as its bf16 ones are, read ahead
under PDL), 2-16 rows and every block-scaled product `kernels.fp8_gemm` (weights widened in
registers, x untouched).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pdserve.kernels.fp8_gemm import FP8, SCALE_BLOCK, fp8_gemm
from pdserve.kernels.fp8_quant import quantize_per_token
from pdserve.kernels.fp8_w8a8 import MAX_ROWS as W8A8_MAX_ROWS
from pdserve.kernels.fp8_w8a8 import w8a8_linear
from pdserve.kernels.gemv import gemv

E4M3_MAX = 448.0
_MLA_LAYERS = frozenset({"q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"})  # mla.py's
LAYERS = frozenset({"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}) | _MLA_LAYERS
"""Our linear layers that hold FP8 weights (checkpoint names: `CHECKPOINT_LAYERS`)."""
CHECKPOINT_LAYERS = (frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})
                     | _MLA_LAYERS)
SCALE_NAMES = ("weight_scale", "weight_scale_inv")  # compressed-tensors' / quant_method fp8's with blocks
MAX_KERNEL_ROWS = 1  # x kept as it is up to here (kernels.gemv); beyond, per-channel weights take
# cuBLASLt's scaled matmul with x quantized (at 8-16 rows 0.17-0.24 ms a layer on the H100 where the
# untuned fp8_gemm took 0.26: RESULTS "FP8 weights on the H100", benchmarks/fp8_linear.py)


@dataclass(frozen=True, slots=True)
class Fp8Scheme:
    """How a model's FP8 layers hold their scales.

    blocked: one scale per 128 x 128 block; else one per output channel ([N, 1]).
    online: quantized at load from a float checkpoint (per channel), not read from one.
    source: where it came from, for logs and errors (e.g. "compressed-tensors channel").
    """

    blocked: bool
    online: bool
    source: str


def resolve_scheme(quantization_config: dict[str, Any] | None, quantization: str | None) -> Fp8Scheme | None:
    """The scheme a model runs: its checkpoint's (config.json's `quantization_config`), else
    online per-channel when `quantization` is "fp8", else None (no FP8 weights).

    Raises ValueError naming the field of a layout pdserve does not run."""
    scheme = checkpoint_scheme(quantization_config) if quantization_config else None
    if scheme is None and quantization == "fp8":
        scheme = Fp8Scheme(blocked=False, online=True, source="online (per channel)")
    return scheme


def checkpoint_scheme(config: dict[str, Any]) -> Fp8Scheme:
    """A checkpoint's `quantization_config` as a scheme; ValueError naming any field it does
    not describe as FP8 e4m3 weights with tensor, channel or 128 x 128 block scales."""
    method = config.get("quant_method")
    if method == "fp8":
        return _fp8_method(config)
    if method == "compressed-tensors":
        return _compressed_tensors(config)
    raise ValueError(f"quantization_config.quant_method {method!r} is not supported: only 'fp8' "
                     "(tensor or 128x128 block scales) and 'compressed-tensors' FP8")


def _fp8_method(config: dict[str, Any]) -> Fp8Scheme:
    """quant_method "fp8": DeepSeek-V3 / Qwen3-FP8 (weight_block_size [128, 128],
    `weight_scale_inv`), or per-tensor `weight_scale` without blocks."""
    fmt = config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt {fmt!r} is not supported: only 'e4m3'")
    scheme = config.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"quantization_config.activation_scheme {scheme!r} is not supported: 'dynamic' or 'static'")
    block = config.get("weight_block_size")
    if block is None:
        return Fp8Scheme(blocked=False, online=False, source="fp8 per tensor")
    if list(block) != [SCALE_BLOCK, SCALE_BLOCK]:
        raise ValueError(f"quantization_config.weight_block_size {block!r} is not supported: only "
                         f"[{SCALE_BLOCK}, {SCALE_BLOCK}]")
    return Fp8Scheme(blocked=True, online=False, source="fp8 128x128 blocks")


def _compressed_tensors(config: dict[str, Any]) -> Fp8Scheme:
    """compressed-tensors (llm-compressor's FP8 / FP8_DYNAMIC / FP8_BLOCK schemes): format
    float-quantized, every config group's weights 8-bit float, symmetric, static, by tensor,
    channel or [128, 128] block; activations none, or 8-bit float by tensor or token."""
    fmt = config.get("format")
    if fmt != "float-quantized":
        raise ValueError(f"quantization_config.format {fmt!r} is not supported: only 'float-quantized' (FP8)")
    for field in ("kv_cache_scheme", "output_activations"):
        if config.get(field):
            raise ValueError(f"quantization_config.{field} is not supported (an FP8 KV cache is "
                             "--kv-cache-dtype fp8, unscaled)")
    groups = config.get("config_groups") or {}
    if not groups:
        raise ValueError("quantization_config.config_groups is empty: no quantized layers described")
    strategies = {_group_strategy(name, group) for name, group in groups.items()}
    if len(strategies) != 1:
        raise ValueError(f"quantization_config.config_groups mix weight strategies {sorted(strategies)}: "
                         "one model, one strategy")
    strategy = strategies.pop()
    return Fp8Scheme(blocked=strategy == "block", online=False, source=f"compressed-tensors {strategy}")


def _group_strategy(name: str, group: dict[str, Any]) -> str:
    where = f"quantization_config.config_groups.{name}"
    if "Linear" not in (group.get("targets") or []):
        raise ValueError(f"{where}.targets {group.get('targets')!r} is not supported: only ['Linear']")
    weights = group.get("weights") or {}
    _check_float8(weights, f"{where}.weights")
    if weights.get("dynamic") or weights.get("symmetric", True) is not True:
        raise ValueError(f"{where}.weights must be static and symmetric (dynamic={weights.get('dynamic')!r}, "
                         f"symmetric={weights.get('symmetric')!r})")
    strategy = weights.get("strategy")
    if strategy not in ("tensor", "channel", "block"):
        raise ValueError(f"{where}.weights.strategy {strategy!r} is not supported: tensor, channel or block")
    if strategy == "block" and list(weights.get("block_structure") or []) != [SCALE_BLOCK, SCALE_BLOCK]:
        raise ValueError(f"{where}.weights.block_structure {weights.get('block_structure')!r} is not supported: "
                         f"only [{SCALE_BLOCK}, {SCALE_BLOCK}]")
    acts = group.get("input_activations")
    if acts:
        _check_float8(acts, f"{where}.input_activations")
        if acts.get("strategy") not in ("tensor", "token"):
            raise ValueError(f"{where}.input_activations.strategy {acts.get('strategy')!r} is not supported: "
                             "tensor or token")
    return strategy


def _check_float8(args: dict[str, Any], where: str) -> None:
    if args.get("num_bits") != 8 or args.get("type") != "float":
        raise ValueError(f"{where} (num_bits={args.get('num_bits')!r}, type={args.get('type')!r}) is not "
                         "supported: only 8-bit float (e4m3)")


def is_layer_weight(name: str) -> bool:
    """Whether a (normalized) checkpoint tensor is the weight of a layer that FP8 quantizes:
    a dense or shared-expert projection, or one expert's gate, up or down."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in CHECKPOINT_LAYERS


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (float8_e4m3fn [N, K], float32 scales [N, 1]): each row scaled so its
    largest magnitude is 448, rounded to nearest (ties to even); an all-zero row gets a tiny
    scale and stays zero."""
    w = weight.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8), scale


def quantized_online(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A float checkpoint's tensors (normalized: `loading.normalize`, experts one by one) as a
    per-channel FP8 checkpoint holds them: each layer weight quantized (`quantize_per_channel`)
    and followed by its `weight_scale`; the rest, and weights already FP8, as they are."""
    for name, tensor in weights:
        if is_layer_weight(name) and tensor.dtype != FP8:
            quantized, scale = quantize_per_channel(tensor)
            yield name, quantized
            yield f"{name}_scale", scale
        else:
            yield name, tensor


def dequantize(weight: torch.Tensor, scale: torch.Tensor, blocked: bool) -> torch.Tensor:
    """weight [..., N, K] float8_e4m3fn times its scales ([..., N, 1], or per 128 x 128 block
    of the last two dims) in float32."""
    if blocked:
        n, k = weight.shape[-2:]
        scale = scale.repeat_interleave(SCALE_BLOCK, -2)[..., :n, :].repeat_interleave(SCALE_BLOCK, -1)[..., :k]
    return weight.float() * scale


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
           blocked: bool, w8a8: bool = False) -> torch.Tensor:
    """x [T, K] @ dequantize(weight, scale).T (+ bias) -> [T, N] in x's dtype.

    CPU: the weight dequantized to float32 for this call. CUDA: `kernels.gemv` for one row;
    beyond, per-channel weights go through cuBLASLt's scaled matmul with x quantized per token
    (`_scaled_mm`), block scales (and shapes it does not take) through `kernels.fp8_gemm`.
    w8a8 (opt-in, not yet run on a GPU; benchmarks/fp8_linear.py --sweep): 2-512 rows of either
    scale layout through `kernels.fp8_w8a8` (x quantized per token, e4m3 x e4m3 dots)."""
    if not x.is_cuda:
        return nn.functional.linear(x, dequantize(weight, scale, blocked).to(x.dtype), bias)
    x = x if x.stride(-1) == 1 else x.contiguous()
    if x.shape[0] <= MAX_KERNEL_ROWS:  # a model's weights are final: read ahead
        return gemv(x, weight, bias, read_ahead=True, scale=scale, blocked=blocked)
    if w8a8 and x.shape[0] <= W8A8_MAX_ROWS and _has_fp8_mma(x.device):
        return w8a8_linear(x, weight, scale, bias, blocked=blocked)
    if blocked or not _scaled_mm_fits(x, weight):
        return fp8_gemm(x, weight, scale, bias, blocked=blocked)
    return _scaled_mm(x, weight, scale, bias)


def _scaled_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """cuBLASLt's row-wise scaled FP8 matmul: FP8 tensor cores (compute capability 8.9+),
    bfloat16 out, N and K multiples of 16."""
    return (x.dtype == torch.bfloat16 and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0
            and _has_fp8_mma(x.device))


@functools.cache
def _has_fp8_mma(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x quantized per token (each row's amax / 448, `kernels.fp8_quant`) times the
    per-channel weights, on the FP8 tensor cores, scaled back in cuBLASLt's epilogue; the bias
    added after (in bfloat16)."""
    x_fp8, x_scale = quantize_per_token(x)
    y = torch._scaled_mm(x_fp8, weight.t(), scale_a=x_scale, scale_b=scale.reshape(1, -1), out_dtype=x.dtype)
    return y if bias is None else y + bias
