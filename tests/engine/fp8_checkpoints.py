"""FP8 checkpoints made here, as the tools that ship them write them: tiny transformers models
whose linear layers are quantized by this file's own torch code (per tensor, per channel, per
128 x 128 block) and saved with `safetensors` beside a config.json carrying the format's
`quantization_config` (compressed-tensors' float-quantized groups, or quant_method "fp8" with
DeepSeek-V3's `weight_scale_inv`). The reference is the same transformers model with every
quantized weight replaced by its dequantized float32 value: what the checkpoint means.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
BLOCK = 128
LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize(w: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float32 -> (e4m3 [N, K], scale): "tensor" [1], "channel" [N, 1], "block"
    [ceil(N/128), ceil(K/128)] (the edge blocks partial), each the amax of what it covers / 448."""
    n, k = w.shape
    if strategy == "tensor":
        scale = (w.abs().amax() / E4M3_MAX).reshape(1)
        full = scale.expand(n, k)
    elif strategy == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / E4M3_MAX
        full = scale.expand(n, k)
    else:
        rows, cols = -(-n // BLOCK), -(-k // BLOCK)
        padded = torch.zeros(rows * BLOCK, cols * BLOCK)
        padded[:n, :k] = w.abs()
        scale = padded.reshape(rows, BLOCK, cols, BLOCK).amax(dim=(1, 3)) / E4M3_MAX
        full = scale.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
    return (w / full).clamp(-E4M3_MAX, E4M3_MAX).to(FP8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    if scale.numel() == 1 or scale.shape == (n, 1):
        return q.float() * scale.reshape(-1, 1).float()
    return q.float() * scale.float().repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]


def compressed_tensors_config(strategy: str, activations: dict | None) -> dict:
    """What llm-compressor writes for its FP8 schemes (FP8: tensor + static tensor activations;
    FP8_DYNAMIC: channel + dynamic token activations; FP8_BLOCK: block + dynamic group ones)."""
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False,
               "group_size": None, "block_structure": [BLOCK, BLOCK] if strategy == "block" else None,
               "observer": "minmax", "actorder": None}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations, "output_activations": None}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


DYNAMIC_TOKEN = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
STATIC_TENSOR = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}
FP8_BLOCK_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                    "weight_block_size": [BLOCK, BLOCK]}


def save_fp8_checkpoint(hf_model, folder: Path, strategy: str, quantization_config: dict,
                        scale_name: str = "weight_scale", input_scales: bool = False,
                        layers: tuple[str, ...] = LAYERS) -> None:
    """Quantize `hf_model`'s linear layers (those named `layers`, and the experts) by
    `strategy` into `folder` (config.json with `quantization_config`, model.safetensors), and
    set the model's weights to what the checkpoint holds, dequantized: it becomes the float32
    reference."""
    from safetensors.torch import save_file

    tensors = {}
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and hf_model.config.tie_word_embeddings:
            continue
        parts = name.split(".")
        if parts[-1] == "weight" and parts[-2] in layers:
            parts_of = {name: tensor}
        elif parts[-2:] in (["experts", "gate_up_proj"], ["experts", "down_proj"]):  # transformers 5's [E, out, in]
            parts_of = _expert_weights(name, tensor)
        else:
            tensors[name] = tensor.contiguous()
            continue
        for part, weight in parts_of.items():
            q, scale = quantize(weight.float(), strategy)
            tensors[part] = q
            tensors[part.removesuffix("weight") + scale_name] = scale
            if input_scales:
                tensors[part.removesuffix("weight") + "input_scale"] = torch.tensor([0.01])
            with torch.no_grad():
                weight.copy_(dequantize(q, scale))
    folder.mkdir(parents=True, exist_ok=True)
    hf_model.config.save_pretrained(str(folder))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(folder / "model.safetensors"))


def _expert_weights(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A stacked expert tensor as per-expert checkpoint weights (views: writing them writes it),
    named as llm-compressor saves MoE models (`experts.{e}.gate_proj.weight` ...)."""
    prefix = name.removesuffix(name.split(".")[-1])
    if name.endswith("down_proj"):
        return {f"{prefix}{e}.down_proj.weight": tensor[e] for e in range(tensor.shape[0])}
    half = tensor.shape[1] // 2
    return {f"{prefix}{e}.{part}.weight": tensor[e, rows]
            for e in range(tensor.shape[0]) for part, rows in (("gate_proj", slice(0, half)),
                                                               ("up_proj", slice(half, None)))}


def rewrite(folder: Path, tensors: dict[str, torch.Tensor] | None = None, config: dict | None = None) -> None:
    """Change a saved checkpoint: tensors replaced or added (None: removed), config.json's
    quantization_config replaced."""
    from safetensors.torch import load_file, save_file

    if tensors:
        held = load_file(str(folder / "model.safetensors"))
        for name, tensor in tensors.items():
            if tensor is None:
                held.pop(name)
            else:
                held[name] = tensor
        save_file(held, str(folder / "model.safetensors"))
    if config is not None:
        data = json.loads((folder / "config.json").read_text())
        data["quantization_config"] = config
        (folder / "config.json").write_text(json.dumps(data, indent=2))
