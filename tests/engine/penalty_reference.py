"""OpenAI's and Hugging Face's logits processing written out in plain torch, dense, one row at a
time: the reference `engine/penalties.py` is held to."""

from __future__ import annotations

import torch

from pdserve.engine.sampling import SamplingParams


def reference_logits(logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int], params: SamplingParams,
                     eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    """One row's logits [vocab] after logit_bias and min_tokens (vLLM applies them first), HF's
    repetition penalty over prompt and output, then OpenAI's frequency and presence penalties
    over the output: logit[t] -= frequency * count[t] + presence * (count[t] > 0)."""
    x = logits.clone()
    for token_id, bias in params.logit_bias:
        x[token_id] += bias
    if len(output_ids) < params.min_tokens:
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        x[sorted(stops)] = float("-inf")
    seen = sorted(set(prompt_ids) | set(output_ids))
    v = x[seen]
    x[seen] = torch.where(v > 0, v / params.repetition_penalty, v * params.repetition_penalty)
    counts = torch.bincount(torch.tensor(output_ids, dtype=torch.int64), minlength=x.shape[0]).to(x.dtype)
    return x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(x.dtype)
