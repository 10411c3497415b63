"""Hugging Face `generate` as the reference, and the near-tie rule for comparing with it."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

NEAR_TIE = 1e-4


def hf_greedy(hf_model, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """HF's greedy continuation and its per-step logits [steps, vocab]."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model.generate(ids, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                                return_dict_in_generate=True, pad_token_id=hf_model.config.eos_token_id)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float()


def hf_greedy_batch(hf_model, prompts: list[list[int]], new_tokens: int) -> list[tuple[list[int], torch.Tensor]]:
    """`hf_greedy` of each prompt, computed in one left-padded `generate` (its steps are the
    batch's, not each prompt's: several times faster on a CPU). Each prompt's continuation ends
    at its first end-of-sequence token, where `generate` alone would have stopped."""
    if len(prompts) == 1:
        return [hf_greedy(hf_model, prompts[0], new_tokens)]
    eos = hf_model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    pad = hf_model.config.eos_token_id if hf_model.config.eos_token_id is not None else 0
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                output_logits=True, return_dict_in_generate=True, pad_token_id=pad)
    logits = torch.stack(out.logits, dim=1).float()  # [prompts, steps, vocab]
    results = []
    for row, tokens in enumerate(out.sequences[:, width:].tolist()):
        end = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
        results.append((tokens[:end], logits[row, :end]))
    return results


def assert_matches_reference(got: list[int], want: list[int], logits: torch.Tensor, what: str,
                             near_tie: float = NEAR_TIE) -> None:
    for step, (g, w) in enumerate(zip(got, want)):
        if g != w:
            top2 = logits[step].topk(2)
            gap = (top2.values[0] - top2.values[1]).item()
            assert g in top2.indices.tolist() and gap < near_tie, (
                f"{what}: token {step} is {g}, HF chose {w} with a top-2 gap of {gap:.2e} (not a near-tie)")
            return  # past a tie the continuations legitimately differ
    assert len(got) == len(want), f"{what}: {len(got)} tokens, HF produced {len(want)}"


def hf_fp8_cache(hf_model):
    """A cache for HF's forward that rounds K/V to e4m3 as they enter it (as an FP8 pool does)."""
    from transformers import DynamicCache

    from pdserve.kernels.fp8 import quantize

    class RoundedCache(DynamicCache):
        """K/V rounded to e4m3 (and back to float32) as they are stored."""

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return super().update(quantize(key_states).float(), quantize(value_states).float(), layer_idx,
                                  *args, **kwargs)

    return RoundedCache(config=hf_model.config)


def e4m3_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable e4m3 values apart a and b are, element by element."""
    a, b = a.view(torch.uint8).int(), b.view(torch.uint8).int()
    same_sign = (a & 0x80) == (b & 0x80)
    return torch.where(same_sign, (a & 0x7F) - (b & 0x7F), (a & 0x7F) + (b & 0x7F)).abs()


class CachedReferences:
    """`hf_greedy` of one model, kept on disk in `folder` (under pytest's cache dir) and
    computed from HF when absent. A reference is keyed by a digest of the model's weights and
    config, the prompt, the number of new tokens and the transformers and torch versions, so a
    changed model or release computes it again. What is kept of each step's logits is what
    `assert_matches_reference` reads of them, the top two (their values and token ids); the
    returned logits hold those two and -inf elsewhere."""

    def __init__(self, folder: Path, hf_model) -> None:
        import transformers

        digest = hashlib.sha256(hf_model.config.to_json_string().encode())
        for name, tensor in sorted(hf_model.state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().contiguous().cpu().numpy().tobytes())
        self._folder = folder
        self._model = hf_model
        self._key = f"{digest.hexdigest()}:{transformers.__version__}:{torch.__version__}"

    def greedy(self, prompts: list[list[int]], new_tokens: int) -> list[tuple[list[int], torch.Tensor]]:
        """`hf_greedy` of each prompt; those not kept yet are computed together (`hf_greedy_batch`)."""
        paths = [self._folder / f"{hashlib.sha256(json.dumps([self._key, p, new_tokens]).encode()).hexdigest()}.pt"
                 for p in prompts]
        missing = [i for i, path in enumerate(paths) if not path.exists()]
        computed = hf_greedy_batch(self._model, [prompts[i] for i in missing], new_tokens) if missing else []
        for i, (tokens, logits) in zip(missing, computed):
            top2 = logits.topk(2, dim=-1)
            partial = paths[i].with_suffix(f".{os.getpid()}.tmp")  # another xdist worker may write it too
            torch.save({"tokens": tokens, "values": top2.values, "ids": top2.indices,
                        "vocab": logits.shape[-1]}, partial)
            os.replace(partial, paths[i])
        return [self._load(path) for path in paths]

    @staticmethod
    def _load(path: Path) -> tuple[list[int], torch.Tensor]:
        kept = torch.load(path)
        logits = torch.full((len(kept["tokens"]), kept["vocab"]), float("-inf"))
        logits.scatter_(1, kept["ids"], kept["values"])
        return kept["tokens"], logits


def fp8_pool_steps(engine, seq, hf_model, num_positions: int | None = None) -> list[torch.Tensor]:
    """Layer by layer, K then V: how many e4m3 values apart the FP8 pool's entries of `seq`'s
    computed positions (its first `num_positions`) are from what HF computes over the same
    tokens, in one forward, with its cache rounded to e4m3 as they enter it ([positions,
    kv_heads, head_dim] each)."""
    n = num_positions or seq.num_computed_tokens
    cache = hf_fp8_cache(hf_model)
    with torch.no_grad():
        hf_model(torch.tensor([seq.token_ids[:n]]), past_key_values=cache, use_cache=True)
    bs = engine.pool.layout.block_size
    slots = torch.tensor([seq.block_ids[p // bs] * bs + p % bs for p in range(n)])
    steps = []
    for layer in range(engine.pool.layout.num_layers):
        for ours, theirs in zip(engine.pool.layer(layer), (cache.layers[layer].keys, cache.layers[layer].values)):
            # exact: HF's values are rounded already
            steps.append(e4m3_steps(ours.flatten(0, 1)[slots], theirs[0].transpose(0, 1).to(torch.float8_e4m3fn)))
    return steps
