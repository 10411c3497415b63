"""Greedy output is token-identical to Hugging Face transformers on the real default model.

The engine runs all prompts as one continuous batch with staggered arrivals and
chunked prefill; the reference runs each prompt alone through HF `generate`.
A divergence is accepted only at a near-tie of the reference (see
hf_reference.NEAR_TIE), and the test checks that it is one.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.engine import Engine
from pdserve.engine.sampling import SamplingParams
from tests.engine.hf_reference import assert_matches_reference, hf_greedy
from tests.engine.prompts import prompt_ids

pytestmark = pytest.mark.slow

NEW_TOKENS = 64
PROMPT_LENGTHS = [5, 17, 48, 96, 160, 310, 455, 600]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)


def run_staggered(engine: Engine, prompts: list[list[int]], arrivals_per_step: int = 2) -> list[list[int]]:
    """Add `arrivals_per_step` prompts, step once, add more...: a continuous batch with staggered arrivals."""
    outputs: dict[str, list[int]] = {}
    ids: list[str] = []
    pending = list(prompts)
    while pending or engine.has_unfinished:
        for prompt in pending[:arrivals_per_step]:
            ids.append(engine.add_request(prompt, GREEDY))
            outputs[ids[-1]] = []
        pending = pending[arrivals_per_step:]
        for delta in engine.step():
            outputs[delta.request_id].extend(delta.token_ids)
    return [outputs[i] for i in ids]


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [prompt_ids(tokenizer, n, variant=i) for i, n in enumerate(PROMPT_LENGTHS)]


@pytest.fixture(scope="module")
def reference(hf_references, prompts) -> list[tuple[list[int], torch.Tensor]]:
    return hf_references.greedy(prompts, NEW_TOKENS)


def test_continuous_batch_matches_hf(make_engine, prompts, reference):
    engine = make_engine(max_num_batched_tokens=256)  # the 600-token prompt is chunked
    got = run_staggered(engine, prompts)
    for i, (g, (want, logits)) in enumerate(zip(got, reference)):
        assert_matches_reference(g, want, logits, f"prompt {i} ({PROMPT_LENGTHS[i]} tokens)")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_preemption_keeps_output_identical(make_engine, prompts, reference):
    # 48 blocks = 768 slots: the longest request (664 tokens) fits alone, all together do not.
    engine = make_engine(num_blocks=48, max_num_batched_tokens=512)
    got = run_staggered(engine, prompts, arrivals_per_step=8)
    assert engine.scheduler.num_preemptions > 0, "the cache was meant to be too small: no preemption happened"
    for i, (g, (want, logits)) in enumerate(zip(got, reference)):
        assert_matches_reference(g, want, logits, f"prompt {i} after preemption")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_shared_prefixes_hit_cache_and_match_hf(make_engine, tokenizer, hf_references):
    prefix = prompt_ids(tokenizer, 200, variant=3)
    prompts = [prefix + prompt_ids(tokenizer, n, variant=10 + n) for n in (7, 30, 65, 1)]
    reference = hf_references.greedy(prompts, NEW_TOKENS)
    engine = make_engine(max_num_batched_tokens=512)
    got = run_staggered(engine, prompts, arrivals_per_step=1)
    hits = engine.block_manager.num_prefix_hits
    assert hits >= 3 * (200 // 16) * 16, f"expected the 200-token prefix to be reused 3 times, hit {hits} tokens"
    for i, (g, (want, logits)) in enumerate(zip(got, reference)):
        assert_matches_reference(g, want, logits, f"shared-prefix prompt {i}")


def test_a_prompt_chunked_over_steps_that_sample_nothing_matches_hf(make_engine, prompts, reference):
    """Every step but the last computes a part of the prompt alone (nothing to sample): its KV must
    be written all the same."""
    engine = make_engine(max_num_batched_tokens=64)
    i = PROMPT_LENGTHS.index(455)
    got = engine.generate([prompts[i]], GREEDY)[0].token_ids
    want, logits = reference[i]
    assert_matches_reference(got, want, logits, "a 455-token prompt in chunks of 64")


# bfloat16 keeps 8 bits of mantissa: over 30 layers the two implementations' logits drift by a
# few hundredths to tenths, so a near-tie in bf16 is a top-2 gap of up to this.
BF16_NEAR_TIE = 0.5


def test_bfloat16_matches_hf_bfloat16(model_folder, prompts):
    """The CPU default on a processor with bf16 matrix units (engine dtype "auto" there): greedy
    bfloat16 output against HF's own bfloat16 forward, alike up to a bf16 near-tie."""
    from transformers import AutoModelForCausalLM

    from pdserve.engine.config import EngineConfig, ModelConfig

    chosen = [prompts[1], prompts[5], prompts[7]]  # 17, 310 and 600 tokens
    hf = AutoModelForCausalLM.from_pretrained(str(model_folder), dtype=torch.bfloat16).eval()
    engine = Engine(EngineConfig(model=ModelConfig(device="cpu", dtype="bfloat16")))
    got = [o.token_ids for o in engine.generate(chosen, SamplingParams(temperature=0.0, max_tokens=16))]
    for i, (g, prompt) in enumerate(zip(got, chosen)):
        want, logits = hf_greedy(hf, prompt, 16)
        assert_matches_reference(g, want, logits, f"bf16 prompt of {len(prompt)} tokens", BF16_NEAR_TIE)
