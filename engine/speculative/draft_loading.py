"""A draft model for speculation, before it drafts: what it needs of its target
(`DraftTarget`), loaded and checked against the target (`load_draft_model`, `check_draft`),
or made of the target's first layers (`self_draft_model`); its head trimmed to the token ids
a ranking names (`draft_head_ids`, `trim_head`)."""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from pdserve.engine.config import ModelConfig, SchedulerConfig, SpecConfig
from pdserve.engine.kv.pool import KVLayout
from pdserve.engine.models.arch import ModelArch
from pdserve.engine.models.decoder import CausalLM
from pdserve.engine.models.layers import Linear
from pdserve.engine.models.registry import param_counts
from pdserve.engine.models.weights import load_model, load_tokenizer, resolve_model
from pdserve.engine.sampler import Sampler


@dataclass(frozen=True, slots=True)
class DraftTarget:
    """What a draft needs of its target engine, and nothing else of it: the model it drafts
    for, where that runs, and how its KV pool and steps are sized."""

    arch: ModelArch
    tokenizer: Any | None
    model: ModelConfig  # the draft loads with the target's settings (dtype, seed, eager)
    device: torch.device
    dtype: torch.dtype
    sampler: Sampler  # the same filtering and the request's own seeded draws
    kv_layout: KVLayout  # its block size and KV dtype (an FP8 target cache, an FP8 draft cache)
    num_kv_blocks: int
    max_model_len: int
    scheduler: SchedulerConfig
    spec: SpecConfig


def self_draft_model(target: CausalLM, num_layers: int) -> CausalLM:
    """The target cut after `num_layers` layers: same embedding, final norm and
    head, no weights of its own (an untrained early exit)."""
    if not 1 <= num_layers <= target.arch.num_layers:
        raise ValueError(f"self-draft layers must be in [1, {target.arch.num_layers}] (the target's), "
                         f"got {num_layers}")
    return _sharing(target, nn.ModuleList(list(target.layers)[:num_layers]), target.lm_head)


def _sharing(model: CausalLM, layers: nn.ModuleList, lm_head: nn.Module) -> CausalLM:
    """A model of `layers` and `lm_head` around `model`'s embedding, final norm and rotary
    tables: no weights of its own, `model` left as it is."""
    with torch.device("meta"):
        shell = type(model)(replace(model.arch, num_layers=0), 1, torch.device("meta"))
    shell.arch = replace(model.arch, num_layers=len(layers))
    shell.embed_tokens, shell.layers, shell.norm, shell.rotary = model.embed_tokens, layers, model.norm, model.rotary
    shell.lm_head = lm_head
    return shell.eval()


def draft_head_ids(config: SpecConfig, vocab_size: int) -> torch.Tensor | None:
    """The token ids a model drafter's head keeps (`SpecConfig.draft_vocab_size` and
    `draft_vocab_file`), sorted; None: the whole vocabulary. Raises ValueError naming what
    is wrong with the size or the file."""
    if config.draft_vocab_size is None and config.draft_vocab_file is None:
        return None
    if config.draft_vocab_file is None:
        ranked = list(range(vocab_size))
    else:
        ranked = load_token_ranking(config.draft_vocab_file, vocab_size)
    size = config.draft_vocab_size or len(ranked)
    if not 1 <= size <= len(ranked):
        where = f"the file's {len(ranked)} ids" if config.draft_vocab_file else f"the vocabulary, {vocab_size}"
        raise ValueError(f"SpecConfig.draft_vocab_size must be in [1, {len(ranked)}] ({where}), got {size}")
    return torch.tensor(sorted(ranked[:size]), dtype=torch.int64)


def load_token_ranking(path: str, vocab_size: int) -> list[int]:
    """Token ids, most frequent first, from `path`: a `torch.save`d list or 1-D tensor (as
    FR-Spec publishes them, e.g. freq_32768.pt) or a JSON list."""
    try:
        if path.endswith((".pt", ".pth")):
            raw = torch.load(path, map_location="cpu", weights_only=True)
        else:
            with open(path) as f:
                raw = json.load(f)
    except (OSError, ValueError, RuntimeError, pickle.UnpicklingError) as e:
        raise ValueError(f"SpecConfig.draft_vocab_file {path!r} cannot be read: {e}") from e
    ids = raw.tolist() if isinstance(raw, torch.Tensor) else raw
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"SpecConfig.draft_vocab_file {path!r} must hold a non-empty list of token ids")
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise ValueError(f"SpecConfig.draft_vocab_file {path!r}: token id {bad} is outside the vocabulary "
                         f"[0, {vocab_size})")
    if len(set(ids)) != len(ids):
        raise ValueError(f"SpecConfig.draft_vocab_file {path!r} lists a token id twice")
    return ids


def trim_head(model: CausalLM, ids: torch.Tensor) -> CausalLM:
    """`model` with a head that scores only token ids `ids` (sorted; see `draft_head_ids`):
    a new model around the same embedding, layers and norm (the one passed in is left
    as it is). Its logits are [N, len(ids)], column j for token ids[j]. When ids are the
    first N, the head is a view of those rows of the model's; else a copy of its rows."""
    weight = model.lm_head.weight.detach()
    n = len(ids)
    rows = weight[:n] if first_ids(ids) else weight.index_select(0, ids.to(weight.device))
    with torch.device("meta"):
        head = Linear(model.arch.hidden_size, n, bias=False)
    head.weight = nn.Parameter(rows, requires_grad=False)
    return _sharing(model, model.layers, head)


def first_ids(ids: torch.Tensor) -> bool:
    """Whether sorted, distinct `ids` are 0..N-1 (a head's columns are then token ids)."""
    return int(ids[-1]) == len(ids) - 1


def load_draft_model(source: str, target: DraftTarget) -> CausalLM:
    """Load the draft named by `source` on the target's device and dtype, after
    checking (ValueError) that it can draft for the target at all."""
    config = replace(target.model, source=source, max_model_len=None)
    files = resolve_model(config)
    check_draft(files.arch, load_tokenizer(files), target.arch, target.tokenizer, target.max_model_len)
    return load_model(files, target.max_model_len, target.device, target.dtype, config.seed)


def check_draft(draft: ModelArch, draft_tokenizer: Any | None, target: ModelArch, target_tokenizer: Any | None,
                max_model_len: int) -> None:
    """Refuse a draft that cannot propose for the target (ValueError)."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"draft vocabulary size {draft.vocab_size} differs from the target's {target.vocab_size}")
    if (draft_tokenizer is None) != (target_tokenizer is None):
        raise ValueError("draft and target must both have a tokenizer or both have none")
    if draft_tokenizer is not None and draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError("draft tokenizer differs from the target's (token ids would not mean the same text)")
    draft_params, target_params = param_counts(draft).active, param_counts(target).active
    if draft_params > target_params:
        raise ValueError(f"draft model ({draft_params / 1e6:.1f}M parameters a token reads) is larger than the "
                         f"target ({target_params / 1e6:.1f}M): it would slow decoding down")
    if draft.max_position_embeddings < max_model_len:
        raise ValueError(f"draft context {draft.max_position_embeddings} is shorter than max_model_len {max_model_len}")
