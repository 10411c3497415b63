"""An FP8 KV cache (`CacheConfig.kv_cache_dtype="fp8"`) on the real default model, CPU.

What the pool holds is checked against Hugging Face transformers running the same model
with its K/V rounded to e4m3 as they enter its cache (so that its attention, like ours,
reads the rounded values): the same numbers, position by position, layer by layer. Tokens
are not compared one for one: a value that sits on a rounding boundary rounds one way in
one implementation and the other way in the other (their float32 arithmetic differs in the
last bits), and the step it then changes grows, as it does between any two fp8 engines.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.decode_node.spec import build_speculator
from pdserve.engine.config import SpecConfig
from pdserve.engine.sampling import SamplingParams
from pdserve.kernels import quantize
from tests.engine.prompts import prompt_ids

pytestmark = pytest.mark.slow


def _hf_fp8_cache(hf_model):
    from transformers import DynamicCache

    class RoundedCache(DynamicCache):
        """K/V rounded to e4m3 (and back to float32) as they are stored."""

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return super().update(quantize(key_states).float(), quantize(value_states).float(), layer_idx,
                                  *args, **kwargs)

    return RoundedCache(config=hf_model.config)


def test_the_pool_holds_what_hf_computes_with_its_kv_rounded(make_engine, hf_model, tokenizer):
    # Chunked prefill (70 tokens in steps of 32), then decodes; one sequence, no overlap, so
    # that the positions written are exactly the ones computed.
    engine = make_engine(num_blocks=64, max_num_batched_tokens=32, enable_prefix_caching=False,
                         async_scheduling=False, kv_cache_dtype="fp8")
    assert engine.pool.kv.dtype == torch.float8_e4m3fn
    engine.add_request(prompt_ids(tokenizer, 70), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    while not engine.scheduler.running or engine.scheduler.running[0].num_output_tokens < 24:
        engine.step()
    seq = engine.scheduler.running[0]
    n = seq.num_computed_tokens
    cache = _hf_fp8_cache(hf_model)
    with torch.no_grad():
        hf_model(torch.tensor([seq.token_ids[:n]]), past_key_values=cache, use_cache=True)
    bs = engine.pool.layout.block_size
    slots = torch.tensor([seq.block_ids[p // bs] * bs + p % bs for p in range(n)])
    equal, total = [], 0
    for layer in range(engine.pool.layout.num_layers):
        for ours, theirs in zip(engine.pool.layer(layer), (cache.layers[layer].keys, cache.layers[layer].values)):
            got = ours.flatten(0, 1)[slots].float()            # [n, kv_heads, head_dim]
            want = theirs[0].transpose(0, 1)                    # [n, kv_heads, head_dim]
            equal.append(int((got == want).sum()))
            total += got.numel()
    # Layer 0's K/V follow from the embeddings alone: equal but for a boundary case or two.
    assert min(equal[:2]) >= 0.999 * total / len(equal), equal[:2]
    # Deeper layers see attention over rounded values: still nearly all the same numbers
    # (measured 98.5%; a float32 pool matches none of them).
    assert sum(equal) >= 0.95 * total, sum(equal) / total
    engine.abort(seq.request_id)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_the_pool_holds_four_times_the_float32_tokens(make_engine):
    full, fp8 = make_engine(), make_engine(kv_cache_dtype="fp8")
    assert fp8.pool.kv.element_size() == 1 and fp8.pool.num_blocks == 4 * full.pool.num_blocks
    assert fp8.pool.layout.bytes_per_block * 4 == full.pool.layout.bytes_per_block


def test_speculation_over_fp8_caches_keeps_greedy_output(make_engine, tokenizer):
    """The draft's pool is FP8 too; a draft equal to the target proposes what it decodes."""
    engine = make_engine(max_num_batched_tokens=64, kv_cache_dtype="fp8")
    prompts = [engine.apply_chat_template([{"role": "user", "content": "Name three uses of a paperclip."}]),
               prompt_ids(tokenizer, 90, variant=2)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    want = [o.token_ids for o in engine.generate(prompts, params)]
    engine.set_speculator(build_speculator(engine, SpecConfig(method="draft_model", draft_model="default",
                                                              num_speculative_tokens=4)))
    try:
        assert engine.speculator.drafter.pool.kv.dtype == torch.float8_e4m3fn
        got = [o.token_ids for o in engine.generate(prompts, params)]
        metrics = engine.speculator.metrics
    finally:
        engine.set_speculator(None)
    assert got == want
    assert metrics.num_proposed > 0 and metrics.num_accepted >= 0.9 * metrics.num_proposed
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
