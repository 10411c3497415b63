"""From checkpoint tensors (Hugging Face names) to a model's parameters, for every family.

Our parameters are Hugging Face's, named the same way, except that some are fused: q, k, v
into `qkv_proj`, gate and up into `gate_up_proj`, and a MoE layer's experts into two
stacked tensors, `experts.w13` (each expert's gate and up) and `experts.w2` (its down).
`place` says where a checkpoint tensor goes on this rank (which parameter, which expert,
which rows, which slice of the tensor the rank keeps); `checkpoint_names` is the inverse,
the tensors a checkpoint of the model holds, which dummy weights are made from. Both know
only these fusings and the tensor-parallel splits, nothing of any one family: a family's
own names (Mixtral's `block_sparse_moe.experts.N.w1`) are renamed to these first by
`normalize`, and fused 3-D expert tensors are split into per-expert ones.

An FP8 layer (`fp8.py`) has a second parameter, `weight_scale`, placed as its weight is:
the same rows of a fused layer and of a rank's shard for per-channel scales (a per-tensor
scale repeated over its tensor's rows), the same rows and columns divided by 128 for block
scales, which therefore must start on a block (a fused part or a rank's slice that does not
is refused, naming it). A static `input_scale` is checked and dropped (fp8.py says why).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from pdserve.engine.models import fp8
from pdserve.engine.models.arch import ModelArch
from pdserve.engine.models.parallel import ShardPlan

FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
EXPERT_PARTS = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0)}
RENAMES = (("block_sparse_moe.", "mlp."), (".w1.weight", ".gate_proj.weight"), (".w3.weight", ".up_proj.weight"),
           (".w2.weight", ".down_proj.weight"))  # Mixtral's checkpoint names
_UNFUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def normalize(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors under our names' conventions: without the `model.` prefix,
    Mixtral's expert names renamed, and fused 3-D expert tensors (`experts.gate_up_proj`
    [E, 2I, H], `experts.down_proj` [E, H, I], as transformers 5 holds them) split into
    per-expert ones (`experts.{e}.gate_proj.weight` ...)."""
    for name, tensor in weights:
        name = name.removeprefix("model.")
        if ".block_sparse_moe." in name:
            for old, new in RENAMES:
                name = name.replace(old, new)
        if name.endswith("experts.gate_up_proj") and tensor.dim() == 3:
            prefix, half = name.removesuffix("gate_up_proj"), tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                yield f"{prefix}{e}.gate_proj.weight", tensor[e, :half]
                yield f"{prefix}{e}.up_proj.weight", tensor[e, half:]
        elif name.endswith("experts.down_proj") and tensor.dim() == 3:
            prefix = name.removesuffix("down_proj")
            for e in range(tensor.shape[0]):
                yield f"{prefix}{e}.down_proj.weight", tensor[e]
        else:
            yield name, tensor


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a checkpoint tensor goes: our parameter, the expert (its index along the
    parameter's first dimension), the rows of it (a fused parameter's part), and the slice
    of the tensor this rank keeps (dim, start, length)."""

    name: str
    expert: int | None = None
    rows: tuple[int, int] | None = None
    src: tuple[int, int, int] | None = None

    @property
    def key(self) -> str:
        """What `expected_keys` calls it: a fused parameter's parts by their first row."""
        fused = self.name.split(".")[-2] in _UNFUSED or self.name.endswith(".w13")
        part = f"@{self.rows[0]}" if self.rows is not None and fused else ""
        return f"{self.name}#{self.expert}{part}" if self.expert is not None else f"{self.name}{part}"


def place(name: str, arch: ModelArch, plan: ShardPlan, params: dict[str, nn.Parameter]) -> Placement | None:
    """Where the (normalized) tensor `name` goes on this rank; None: nothing of it here."""
    if (name == "lm_head.weight" and arch.tie_word_embeddings) or "rotary_emb" in name:
        return None
    parts = name.split(".")
    if len(parts) >= 5 and parts[-4] == "experts" and parts[-3].isdigit() and parts[-2] in EXPERT_PARTS:
        return _expert_placement(parts, plan)
    d = arch.head_dim
    if len(parts) >= 4 and parts[-2] in FUSED:
        fused, idx = FUSED[parts[-2]]
        parts[-2] = fused
        target = ".".join(parts)
        if fused == "qkv_proj":
            q, kv = plan.num_heads * d, plan.num_kv_heads * d
            sizes, starts = [q, kv, kv], [plan.rank * q, plan.kv_head_start * d, plan.kv_head_start * d]
        else:
            half = params[target].shape[0] // 2 if target in params else 0
            sizes, starts = [half, half], [plan.rank * half] * 2
        return Placement(target, rows=(sum(sizes[:idx]), sizes[idx]), src=(0, starts[idx], sizes[idx]))
    if plan.size == 1:
        return Placement(name)
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return Placement(name, rows=(0, plan.vocab_rows), src=(0, plan.vocab_start, plan.vocab_rows))
    if name.endswith(("o_proj.weight", "down_proj.weight")) and name in params:
        cols = params[name].shape[1]
        return Placement(name, src=(1, plan.rank * cols, cols))
    return Placement(name)  # norms, routers, the row-parallel layers' biases: whole on every rank


def _expert_placement(parts: list[str], plan: ShardPlan) -> Placement | None:
    expert = int(parts[-3]) - plan.first_expert
    if not 0 <= expert < plan.num_local_experts:
        return None  # another rank's expert (expert parallelism)
    stacked, idx = EXPERT_PARTS[parts[-2]]
    target = ".".join([*parts[:-3], stacked])
    inter = plan.expert_intermediate_size
    start = 0 if plan.expert_parallel else plan.rank * inter  # whole experts, or every rank's slice of each
    if stacked == "w2":
        return Placement(target, expert=expert, src=(1, start, inter))
    return Placement(target, expert=expert, rows=(idx * inter, inter), src=(0, start, inter))


def load(model: nn.Module, arch: ModelArch, plan: ShardPlan, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint tensors into `model`'s parameters, each rank keeping its slice.

    Raises ValueError naming any missing, unexpected or misshapen tensor, a float tensor for
    an FP8 layer (or an FP8 one for another), and a scale whose layout is not the model's."""
    params = dict(model.named_parameters())
    with torch.no_grad():  # vocabulary padding past the last token stays zero
        model.get_parameter("embed_tokens.weight").zero_()
        model.get_parameter("lm_head.weight").zero_()
    loaded: set[str] = set()
    for name, tensor in normalize(weights):
        weight_name, kind = _scale_kind(name)
        where = place(weight_name, arch, plan, params)
        if where is None:
            continue
        if kind is not None:
            scale_param = where.name + "_scale"
            if scale_param not in params:
                raise ValueError(f"unexpected weight {name!r} (no FP8 layer {where.name.rsplit('.', 1)[0]!r})")
            if kind != "weight_scale":
                _check_scalar_scale(name, tensor, kind)
                continue
            key = where.key.replace(where.name, scale_param, 1)
            blocked = model.get_submodule(where.name.rsplit(".", 1)[0]).fp8_blocked
            where, tensor = _scale_placement(name, tensor, where, scale_param, params[scale_param], blocked)
        else:
            key = where.key
        if where.name not in params:
            raise ValueError(f"unexpected weight {name!r} (no parameter {where.name!r})")
        dst = params[where.name].data
        if where.expert is not None:
            dst = dst[where.expert]
        if where.rows is not None:
            dst = dst.narrow(0, *where.rows)
        src = _slice(tensor, where.src)
        if src is None or dst.shape != src.shape:
            shard = " for this rank's shard" if plan.size > 1 else ""
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}{shard}")
        if (dst.dtype == fp8.FP8) != (src.dtype == fp8.FP8):
            raise ValueError(f"weight {name!r} is {src.dtype}, the model holds it as {dst.dtype} (FP8 weights are "
                             f"those of {sorted(fp8.CHECKPOINT_LAYERS)}, all of them)")
        with torch.no_grad():
            dst.copy_(src)
        loaded.add(key)
    missing = expected_keys(model, arch, plan) - loaded
    if missing:
        raise ValueError(f"missing weights: {sorted(missing)[:8]}{' ...' if len(missing) > 8 else ''}")


def _scale_kind(name: str) -> tuple[str, str | None]:
    """(the weight a scale belongs to, "weight_scale" / "input_scale" / "weight_zero_point"),
    or (name, None) for a tensor that is no FP8 scale."""
    for suffix in fp8.SCALE_NAMES:
        if name.endswith(f".{suffix}"):
            return name.removesuffix(suffix) + "weight", "weight_scale"
    for suffix in ("input_scale", "weight_zero_point"):
        if name.endswith(f".{suffix}"):
            return name.removesuffix(suffix) + "weight", suffix
    return name, None


def _check_scalar_scale(name: str, tensor: torch.Tensor, kind: str) -> None:
    """A static activation scale (one positive number: dropped, fp8.py says why) or a zero
    point (zero everywhere: symmetric); anything else is refused."""
    if kind == "input_scale":
        if tensor.numel() != 1 or not bool(torch.isfinite(tensor).all() and (tensor > 0).all()):
            raise ValueError(f"{name!r} must be one positive finite activation scale (per tensor); got shape "
                             f"{tuple(tensor.shape)}")
    elif bool(tensor.any()):
        raise ValueError(f"{name!r} is not zero: asymmetric FP8 weights are not supported")


def _scale_placement(name: str, tensor: torch.Tensor, weight: Placement, target: str, param: nn.Parameter,
                     blocked: bool) -> tuple[Placement, torch.Tensor]:
    """Where a weight's scale goes, given where the weight goes (see the module's docstring),
    and the tensor shaped for it (a per-tensor scale repeated over rows, [N] as [N, 1])."""
    if not blocked:
        src = weight.src if weight.src is not None and weight.src[0] == 0 else None  # a column slice: every row
        if tensor.numel() == 1:
            held = param.shape[1] if weight.expert is not None else param.shape[0]  # [E, rows, 1] or [rows, 1]
            rows = src[1] + src[2] if src is not None else weight.rows[1] if weight.rows else held
            tensor = tensor.reshape(1, 1).expand(rows, 1)
        elif tensor.dim() == 1:
            tensor = tensor.unsqueeze(1)
        return Placement(target, expert=weight.expert, rows=weight.rows, src=src), tensor
    block = fp8.SCALE_BLOCK
    if weight.rows is not None and weight.rows[0] % block:
        raise ValueError(f"block scales {name!r}: its rows start at row {weight.rows[0]} of the fused "
                         f"{target.removesuffix('.weight_scale')!r}, not on a {block}-row block")
    if weight.src is not None and weight.src[1] % block:
        raise ValueError(f"block scales {name!r}: this rank's slice starts at {weight.src[1]} along dim "
                         f"{weight.src[0]}, not on a {block} block (use fewer tensor-parallel ranks)")
    rows = (weight.rows[0] // block, -(-weight.rows[1] // block)) if weight.rows is not None else None
    src = (weight.src[0], weight.src[1] // block, -(-weight.src[2] // block)) if weight.src is not None else None
    return Placement(target, expert=weight.expert, rows=rows, src=src), tensor


def _slice(tensor: torch.Tensor, src: tuple[int, int, int] | None) -> torch.Tensor | None:
    """tensor.narrow(*src), or None where the tensor is too small for it."""
    if src is None:
        return tensor
    dim, start, length = src
    if tensor.dim() <= dim or tensor.shape[dim] < start + length:
        return None
    return tensor.narrow(dim, start, length)


def expected_keys(model: nn.Module, arch: ModelArch, plan: ShardPlan) -> set[str]:
    """The `Placement.key` of every part of every parameter a checkpoint must fill (an FP8
    layer's scales: those of its weight, under the scale's name)."""
    params = dict(model.named_parameters())
    keys: set[str] = set()
    for name, param in params.items():
        if name.endswith("_scale"):  # an FP8 layer's weight_scale, FP8 experts' w13_scale / w2_scale
            weight = name.removesuffix("_scale")
            keys |= {key.replace(weight, name, 1) for key in _keys(weight, params[weight], arch, plan)}
        else:
            keys |= _keys(name, param, arch, plan)
    return keys


def _keys(name: str, param: nn.Parameter, arch: ModelArch, plan: ShardPlan) -> set[str]:
    kind = name.split(".")[-1] if name.split(".")[-2] == "experts" else name.split(".")[-2]
    if kind == "qkv_proj":
        q, kv = plan.num_heads * arch.head_dim, plan.num_kv_heads * arch.head_dim
        return {f"{name}@{row}" for row in (0, q, q + kv)}
    if kind == "gate_up_proj":
        return {f"{name}@{row}" for row in (0, param.shape[0] // 2)}
    if kind == "w13":
        return {f"{name}#{e}@{row}" for e in range(param.shape[0]) for row in (0, param.shape[1] // 2)}
    if kind == "w2":
        return {f"{name}#{e}" for e in range(param.shape[0])}
    return {name}


def checkpoint_names(model: nn.Module, arch: ModelArch) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(Hugging Face name, shape) of every tensor a checkpoint of `model` (one rank: the
    whole model) holds, in the parameters' order: the inverse of `place`."""
    for name, param in model.named_parameters():
        parts = name.split(".")
        if name == "lm_head.weight" and arch.tie_word_embeddings:
            continue
        full = name if name == "lm_head.weight" else f"model.{name}"
        if parts[-2] == "experts":
            prefix = full.removesuffix(parts[-1])
            for e in range(param.shape[0]):
                if parts[-1] == "w13":
                    half = param.shape[1] // 2
                    yield f"{prefix}{e}.gate_proj.weight", (half, param.shape[2])
                    yield f"{prefix}{e}.up_proj.weight", (half, param.shape[2])
                else:
                    yield f"{prefix}{e}.down_proj.weight", tuple(param.shape[1:])
        elif parts[-2] in _UNFUSED:
            sizes = _part_sizes(parts[-2], param, arch)
            for part, rows in zip(_UNFUSED[parts[-2]], sizes):
                yield ".".join([*full.split(".")[:-2], part, parts[-1]]), (rows, *param.shape[1:])
        else:
            yield full, tuple(param.shape)


def _part_sizes(fused: str, param: nn.Parameter, arch: ModelArch) -> list[int]:
    if fused == "qkv_proj":
        kv = arch.num_kv_heads * arch.head_dim
        return [param.shape[0] - 2 * kv, kv, kv]
    return [param.shape[0] // 2] * 2
