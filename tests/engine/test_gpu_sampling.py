"""Penalties, logit bias, min_tokens and prompt log-probabilities on CUDA (the batched device
form, CUDA-graph decode, speculative verification) against the same torch references as the
CPU tests, on a tiny random fp32 Llama run by transformers on the same GPU.
Run on a GPU machine: `pytest -m gpu tests/engine/test_gpu_sampling.py`."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from pdserve.engine.engine import Engine
from pdserve.engine.penalties import Penalties
from pdserve.engine.sampling import SamplingParams
from tests.engine.penalty_reference import reference_logits
from tests.engine.test_penalties import EOS, VOCAB, _batch, _reference
from tests.engine.test_prompt_logprobs import assert_matches_hf

pytestmark = pytest.mark.gpu

CHUNK = 64


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                         initializer_range=0.2, eos_token_id=None)
    folder = tmp_path_factory.mktemp("llama")
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.save_pretrained(str(folder))
    engine = Engine(EngineConfig(model=ModelConfig(source=str(folder), device="cuda", dtype="float32"),
                                 cache=CacheConfig(num_blocks=256),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=CHUNK)))
    return engine, hf.cuda()


def _hf_greedy(hf, prompt: list[int], params: SamplingParams) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        for _ in range(params.max_tokens):
            logits = hf(torch.tensor([prompt + out], device="cuda")).logits[0, -1].float().cpu()
            out.append(int(reference_logits(logits, prompt, out, params, ()).argmax()))
    return out


def test_the_batched_form_on_cuda_matches_the_reference_row_by_row():
    seqs = _batch()
    penalties = Penalties(VOCAB, EOS, torch.device("cuda"))
    logits = torch.randn(len(seqs), VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    out = penalties.adjusted(seqs, logits.cuda()).cpu()
    for i, seq in enumerate(seqs):
        torch.testing.assert_close(out[i], _reference(logits[i], seq))


PENALIZED = [
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3),
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.8,
                   logit_bias={7: 4.0, 11: -100.0}),
]


def test_greedy_with_penalties_under_graphs_and_speculation_is_the_references(models):
    engine, hf = models
    gen = torch.Generator().manual_seed(2)
    base = torch.randint(1, 500, (12,), generator=gen).tolist()
    prompt = base * 4  # repetitive: penalties change the greedy path, and the n-gram drafter proposes
    expected = [_hf_greedy(hf, prompt, p) for p in PENALIZED]
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    assert expected[0] != _hf_greedy(hf, prompt, plain)
    outs = engine.generate([prompt] * 3, [*PENALIZED, plain])
    assert [o.token_ids for o in outs[:2]] == expected
    assert engine.runner.graphs is not None
    engine.speculate(SpecConfig(method="ngram", ngram_min=1, ngram_max=3, num_speculative_tokens=3))
    try:
        outs = engine.generate([prompt] * 3, [*PENALIZED, plain])
        assert [o.token_ids for o in outs[:2]] == expected
        assert engine.speculator.metrics.num_passes > 0
    finally:
        engine.speculate(None)


def test_prompt_logprobs_on_cuda_over_chunks_match_hf(models):
    engine, hf = models
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 512, (2 * CHUNK + 17,), generator=gen).tolist()
    other = torch.randint(0, 512, (40,), generator=gen).tolist()
    outs = engine.generate([prompt, other], [SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=5),
                                             SamplingParams(temperature=0, max_tokens=3)])
    with torch.no_grad():
        reference = torch.log_softmax(hf(torch.tensor([prompt], device="cuda")).logits[0].float(), dim=-1).cpu()
    assert_matches_hf(outs[0].prompt_logprobs, prompt, reference, 5, tolerance=1e-3)  # fp32 kernels, other sum orders
    assert outs[1].prompt_logprobs == []



def test_log_probabilities_are_read_once_the_gpu_has_computed_them(monkeypatch):
    """Issue 52: the verified tokens' log-probabilities (`Sampler.logprobs`, what speculative
    verification reports) were copied to pinned host memory without a wait and read at once:
    behind a busy GPU (in the field, other processes on the card) they were whatever that
    memory held before. Here the GPU is kept busy (~0.1 s) right before the log-softmax is
    queued (after the token ids' upload, which waits for the stream); every read must wait
    for its copy, the sampled rows' too."""
    from pdserve.engine import sampler as sampler_module

    upload = sampler_module.on_device

    def on_busy_device(values, dtype, device):
        out = upload(values, dtype, device)
        torch.cuda._sleep(200_000_000)
        return out

    monkeypatch.setattr(sampler_module, "on_device", on_busy_device)
    sampler = sampler_module.Sampler(seed=0, device=torch.device("cuda"))
    for attempt in range(3):
        logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(10 + attempt)) * 4
        ref = torch.log_softmax(logits, dim=-1)
        tokens = [int(t) for t in ref.argsort(dim=-1)[:, -1 - attempt]]  # each row's rank 1 + attempt
        given = sampler.logprobs(logits.cuda(), tokens, SamplingParams(logprobs=2))
        assert [g.logprob for g in given] == pytest.approx(ref[torch.arange(4), tokens].tolist(), abs=1e-5)
        assert [g.rank for g in given] == [1 + attempt] * 4
        assert [list(g.top_token_ids) for g in given] == ref.topk(2, dim=-1).indices.tolist()
        out = sampler.sample(logits.cuda(), [SamplingParams(temperature=0.0, logprobs=1)] * 4, [0] * 4)
        assert out.token_ids == ref.argmax(dim=-1).tolist()
        assert [lp.logprob for lp in out.logprobs] == pytest.approx(ref.max(dim=-1).values.tolist(), abs=1e-5)
