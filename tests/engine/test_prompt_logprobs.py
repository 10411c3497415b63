"""Prompt log-probabilities (`SamplingParams.prompt_logprobs`) against Hugging Face's forward
on the same prompt: log_softmax of its logits at every position, within 1e-4 (fp32 on the
CPU), for a prompt computed over several chunks beside requests that do not ask for them, and
for a prompt whose prefix is in the prefix cache (computed all the same)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.sampler import TokenLogprobs
from pdserve.engine.sampling import SamplingParams
from tests.engine.prompts import prompt_ids

TOLERANCE = 1e-4
CHUNK = 32  # the engine's token budget per step: longer prompts are computed in chunks
NUM_TOP = 5


@pytest.fixture(scope="module")
def chunked_engine(make_engine):
    return make_engine(max_num_batched_tokens=CHUNK)


def hf_logprobs(hf_model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab]: row p is the log-distribution of the token after position p."""
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def assert_matches_hf(entries: list[TokenLogprobs | None], prompt: list[int], reference: torch.Tensor,
                      num_top: int, tolerance: float = TOLERANCE) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for i, entry in enumerate(entries[1:], start=1):
        ref = reference[i - 1]
        assert entry is not None and entry.token_id == prompt[i]
        want = ref[prompt[i]].item()
        assert abs(entry.logprob - want) < tolerance, f"prompt token {i}: {entry.logprob} vs HF's {want}"
        # Its rank, up to tokens within the tolerance of it.
        lo, hi = int((ref > want + tolerance).sum()) + 1, int((ref > want - tolerance).sum()) + 1
        assert lo <= entry.rank <= hi, f"prompt token {i}: rank {entry.rank}, HF's in [{lo}, {hi}]"
        assert len(entry.top_token_ids) == num_top
        top = ref.topk(num_top).values
        assert torch.allclose(torch.tensor(entry.top_logprobs), top, atol=tolerance)
        got = ref[list(entry.top_token_ids)]
        assert torch.allclose(torch.tensor(entry.top_logprobs), got, atol=tolerance)


def test_a_chunked_prompt_beside_other_requests_matches_hf(chunked_engine, hf_model, tokenizer):
    prompt = prompt_ids(tokenizer, 2 * CHUNK + 17, variant=5)
    others = [prompt_ids(tokenizer, n, variant=20 + n) for n in (20, 40)]
    params = [SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=NUM_TOP)] + \
        [SamplingParams(temperature=0, max_tokens=3)] * 2
    outs = chunked_engine.generate([prompt, *others], params)
    assert_matches_hf(outs[0].prompt_logprobs, prompt, hf_logprobs(hf_model, prompt), NUM_TOP)
    assert outs[1].prompt_logprobs == [] and outs[2].prompt_logprobs == []
    assert len(outs[0].token_ids) == 3


def test_a_cached_prefix_is_computed_again_for_them(chunked_engine, hf_model, tokenizer):
    prefix = prompt_ids(tokenizer, 2 * CHUNK, variant=7)
    prompt = prefix + prompt_ids(tokenizer, 9, variant=30)
    warm = chunked_engine.generate([prefix + [tokenizer.encode(" x")[0]]], SamplingParams(temperature=0,
                                                                                           max_tokens=1))[0]
    assert warm.prompt_logprobs == []
    hits = chunked_engine.block_manager.num_prefix_hits
    plain = chunked_engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0]
    assert plain.num_cached_tokens >= CHUNK, "the prefix was meant to be in the cache"
    assert chunked_engine.block_manager.num_prefix_hits > hits
    out = chunked_engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    assert out.num_cached_tokens == 0
    assert out.token_ids == plain.token_ids
    assert_matches_hf(out.prompt_logprobs, prompt, hf_logprobs(hf_model, prompt), 0)


def test_a_one_token_prompt_has_only_its_null_entry(chunked_engine):
    out = chunked_engine.generate([[42]], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0]
    assert out.prompt_logprobs == [None]


@pytest.mark.parametrize("value", [-1, 21])
def test_out_of_range_is_refused_by_name(value):
    with pytest.raises(ValueError, match="prompt_logprobs must be in"):
        SamplingParams(prompt_logprobs=value)
