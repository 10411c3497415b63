"""Sampling with speculation keeps the target's distribution, end to end in the engine.

A tiny random model with a 16-token vocabulary, its weights spread out so that
its distributions are far from uniform and the self-draft's differ from the
target's. Thousands of seeded requests each generate four tokens; the first
comes from the prompt's pass, the next ones from speculative verification. The
second and third tokens' frequencies are compared with their exact
distributions, computed from the target's full logprobs of every prefix.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import pdserve.engine.speculative.rejection as rejection_module
from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig, SpecConfig
from pdserve.engine.engine import Engine
from pdserve.engine.models.arch import DUMMY_SHAPES, ModelArch
from pdserve.engine.sampler import Sampler
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.sequence import Sequence
from pdserve.engine.speculative import SpecDecoder
from pdserve.engine.speculative.drafter import HostDrafter
from pdserve.engine.speculator import Proposals
from tests.engine.speculative.stats import chi_square_pvalue, resample_from_target_batched

VOCAB = 16
PROMPT = [1, 2, 3, 4, 5, 6]
NUM_SAMPLES = 2000
SHAPES = {
    "spec-test": ModelArch(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=True,
                           eos_token_ids=(0,)),
    "spec-test-draft": ModelArch(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                                 num_kv_heads=1, head_dim=8, max_position_embeddings=256, tie_word_embeddings=True,
                                 eos_token_ids=(0,)),
}


@pytest.fixture(scope="module")
def engine():
    with pytest.MonkeyPatch.context() as mp:
        for name, arch in SHAPES.items():
            mp.setitem(DUMMY_SHAPES, name, arch)
        eng = Engine(EngineConfig(model=ModelConfig(source="dummy:spec-test", device="cpu", dtype="float32"),
                                  cache=CacheConfig(num_blocks=1024)))
        # Dummy weights (std 0.02) make every layer a near no-op and every
        # distribution near uniform; spread them so the test has teeth.
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for param in eng.model.parameters():
                if param.dim() == 2:
                    param.normal_(0.0, 0.3, generator=gen)
        yield eng


def _next_token_probs(engine: Engine, prefixes: list[list[int]]) -> torch.Tensor:
    """[len(prefixes), VOCAB]: the target's exact next-token distribution (temperature 1)."""
    outs = engine.generate(prefixes, SamplingParams(temperature=0.0, max_tokens=1, logprobs=VOCAB, ignore_eos=True))
    probs = torch.zeros(len(prefixes), VOCAB)
    for row, out in zip(probs, outs):
        lp = out.logprobs[0]
        row[list(lp.top_token_ids)] = torch.tensor(lp.top_logprobs).exp()
    return probs


@pytest.fixture(scope="module")
def exact_marginals(engine) -> tuple[torch.Tensor, torch.Tensor]:
    """The distributions of the 2nd and 3rd generated tokens."""
    engine.speculate(None)
    p1 = _next_token_probs(engine, [PROMPT])[0]
    p2 = _next_token_probs(engine, [PROMPT + [a] for a in range(VOCAB)])
    p3 = _next_token_probs(engine, [PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)])
    p3 = p3.view(VOCAB, VOCAB, VOCAB)
    return p1 @ p2, torch.einsum("a,ab,abc->c", p1, p2, p3)


class UniformDrafter(HostDrafter):
    """Proposes uniformly random tokens: a legal draft as far from the target as it gets."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self.generator = torch.Generator().manual_seed(0)  # apart from the target's draws

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposals:
        ids, probs = [], []
        for k in num_tokens:
            ids.append(torch.randint(VOCAB, (k,), generator=self.generator).tolist())
            probs.append(torch.full((k, VOCAB), 1.0 / VOCAB))
        return Proposals.from_lists(ids, self.sampler.device, probs)

    def release(self, seq: Sequence) -> None:
        pass


def _speculate(engine: Engine, method: str, tmp_path=None) -> SpecDecoder:
    """Speculate with `method`'s drafter from now on; returns the speculator."""
    if method == "uniform":  # the drafter's own method: K and the rule are the config's
        engine.speculate(SpecConfig(method="ngram", num_speculative_tokens=3), drafter=UniformDrafter(engine.sampler))
        return engine.speculator
    # "draft_model_head_10": the draft proposes only among token ids 0-9; "draft_model_head_odd":
    # only among the odd ones (a ranking file: columns of the head are not their token ids).
    # The target's mass elsewhere must come back through the residual.
    method, _, trim = method.partition("_head_")
    size, path = (int(trim), None) if trim.isdigit() else (None, None)
    if trim == "odd":
        path = tmp_path / "ranking.json"
        path.write_text(json.dumps(list(range(VOCAB - 1, 0, -2))))
    with pytest.MonkeyPatch.context() as mp:
        for name, arch in SHAPES.items():
            mp.setitem(DUMMY_SHAPES, name, arch)
        engine.speculate(SpecConfig(method=method, num_speculative_tokens=3, num_draft_layers=1,
                                    draft_model="dummy:spec-test-draft", draft_vocab_size=size,
                                    draft_vocab_file=str(path) if path else None))
    return engine.speculator


def _sample_marginals(engine: Engine) -> tuple[torch.Tensor, torch.Tensor]:
    params = [SamplingParams(temperature=1.0, max_tokens=4, seed=s, ignore_eos=True) for s in range(NUM_SAMPLES)]
    outs = engine.generate([PROMPT] * NUM_SAMPLES, params)
    second = torch.bincount(torch.tensor([o.token_ids[1] for o in outs]), minlength=VOCAB)
    third = torch.bincount(torch.tensor([o.token_ids[2] for o in outs]), minlength=VOCAB)
    return second, third


@pytest.mark.parametrize("method", ["self_draft", "draft_model", "ngram", "uniform", "draft_model_head_10",
                                    "self_draft_head_odd"])
def test_speculative_sampling_keeps_the_target_distribution(engine, exact_marginals, method, tmp_path):
    spec = _speculate(engine, method, tmp_path)
    try:
        second, third = _sample_marginals(engine)
    finally:
        engine.speculate(None)
    assert spec.metrics.num_passes > NUM_SAMPLES // 2  # the tokens really went through verification
    assert 0 < spec.metrics.num_accepted < spec.metrics.num_proposed
    if "_head_" in method:  # the ids the draft cannot propose carry real mass, and are emitted
        outside = list(range(10, VOCAB)) if method.endswith("_10") else list(range(0, VOCAB, 2))
        assert exact_marginals[0][outside].sum() > 0.1 and second[outside].sum() > 0.1 * NUM_SAMPLES
    assert chi_square_pvalue(second, exact_marginals[0]) > 1e-3
    assert chi_square_pvalue(third, exact_marginals[1]) > 1e-3


def test_the_test_fails_when_the_acceptance_rule_is_broken(engine, exact_marginals, monkeypatch):
    monkeypatch.setattr(rejection_module, "rejection_sample", resample_from_target_batched)
    _speculate(engine, "uniform")
    try:
        second, third = _sample_marginals(engine)
    finally:
        engine.speculate(None)
    assert chi_square_pvalue(second, exact_marginals[0]) < 1e-6


def test_penalized_sampling_with_speculation_keeps_the_penalized_distribution(engine, exact_marginals):
    """Frequency and presence penalties and a bias, judged per verified position with the
    proposals before it counted: the 2nd and 3rd tokens against their exact penalized marginals
    (these penalties and the bias add to the logits, so the model's log-probabilities give them;
    the repetition penalty's per-position counting is held to its reference in test_penalties)."""
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, frequency_penalty=1.5,
                            presence_penalty=1.0, logit_bias={3: 1.0})
    bias = torch.zeros(VOCAB)
    bias[3] = 1.0
    engine.speculate(None)

    def penalized(probs: torch.Tensor, output: list[int]) -> torch.Tensor:
        counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=VOCAB).float()
        return torch.softmax(probs.log() + bias - 1.5 * counts - 1.0 * (counts > 0).float(), dim=-1)

    p1 = penalized(_next_token_probs(engine, [PROMPT])[0], [])
    p2 = _next_token_probs(engine, [PROMPT + [a] for a in range(VOCAB)])
    p3 = _next_token_probs(engine, [PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)]).view(VOCAB, VOCAB, -1)
    p2 = torch.stack([penalized(p2[a], [a]) for a in range(VOCAB)])
    p3 = torch.stack([torch.stack([penalized(p3[a, b], [a, b]) for b in range(VOCAB)]) for a in range(VOCAB)])
    second, third = p1 @ p2, torch.einsum("a,ab,abc->c", p1, p2, p3)
    _speculate(engine, "uniform")
    try:
        seeded = [dataclasses.replace(params, seed=s) for s in range(NUM_SAMPLES)]
        outs = engine.generate([PROMPT] * NUM_SAMPLES, seeded)
    finally:
        engine.speculate(None)
    counts = [torch.bincount(torch.tensor([o.token_ids[i] for o in outs]), minlength=VOCAB) for i in (1, 2)]
    assert chi_square_pvalue(counts[0], second) > 1e-3
    assert chi_square_pvalue(counts[1], third) > 1e-3
    assert chi_square_pvalue(counts[1], exact_marginals[1]) < 1e-6  # the unpenalized distribution: refused
