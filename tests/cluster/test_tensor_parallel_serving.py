"""A colocated worker of tensor-parallel size 3 (the default model's 9 heads and 3 KV heads
split over three CPU processes, gloo) behind real Ray and real gRPC: greedy streams match
Hugging Face transformers, and every block is free afterwards."""

from __future__ import annotations

import pytest

from pdserve.engine.sampling import SamplingParams
from tests.cluster.streams import collect_concurrently, pools_are_full, wait_until
from tests.engine.hf_reference import assert_matches_reference, hf_greedy
from tests.engine.prompts import prompt_ids

pytestmark = pytest.mark.slow

PROMPT_LENGTHS = [5, 48, 130]
NEW_TOKENS = 16


def test_a_tensor_parallel_worker_streams_hf_greedy_tokens(start, tokenizer, hf_model):
    srv = start(pools={"mode": "colocated", "decode_tp": 3})
    prompts = [prompt_ids(tokenizer, n, variant=i) for i, n in enumerate(PROMPT_LENGTHS)]
    params = [SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)] * len(prompts)
    got = collect_concurrently(srv.target, prompts, params)
    for prompt, out in zip(prompts, got):
        want, logits = hf_greedy(hf_model, prompt, NEW_TOKENS)
        assert_matches_reference(out.token_ids, want, logits, f"TP 3 worker, prompt of {len(prompt)}")
    wait_until(lambda: pools_are_full(srv.target), 10, "every block to be free")
