"""Hugging Face `generate` as the reference, and the near-tie rule for comparing with it."""

from __future__ import annotations

import torch

NEAR_TIE = 1e-4


def hf_greedy(hf_model, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """HF's greedy continuation and its per-step logits [steps, vocab]."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model.generate(ids, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                                return_dict_in_generate=True, pad_token_id=hf_model.config.eos_token_id)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float()


def assert_matches_reference(got: list[int], want: list[int], logits: torch.Tensor, what: str) -> None:
    for step, (g, w) in enumerate(zip(got, want)):
        if g != w:
            top2 = logits[step].topk(2)
            gap = (top2.values[0] - top2.values[1]).item()
            assert g in top2.indices.tolist() and gap < NEAR_TIE, (
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
