"""Penalties, logit bias and min_tokens (engine/penalties.py) against a dense torch reference of
OpenAI's and Hugging Face's definitions: the batched device form alone, then the engine on the
real default model, greedy (with and without speculation) and sampled (a chi-square test)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.engine.config import SpecConfig
from pdserve.engine.engine import Engine
from pdserve.engine.penalties import Penalties
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.sequence import PLACEHOLDER_TOKEN_ID, Sequence
from tests.engine.penalty_reference import reference_logits
from tests.engine.speculative.stats import chi_square_pvalue

VOCAB = 64
EOS = (0,)
PENALIZED = SamplingParams(temperature=0.0, max_tokens=64, repetition_penalty=1.7, frequency_penalty=0.6,
                           presence_penalty=-0.4, logit_bias={3: 5.0, 9: -100.0})


def _seq(name: str, prompt: list[int], output: list[int], params: SamplingParams, prior: int = 0) -> Sequence:
    seq = Sequence(name, tuple(prompt), params, 16, num_prior_output_tokens=prior)
    seq.token_ids.extend(output)
    return seq


def _reference(logits: torch.Tensor, seq: Sequence, extra: list[int] = ()) -> torch.Tensor:
    prompt_len = seq.num_prompt_tokens - seq.num_prior_output_tokens
    return reference_logits(logits, seq.token_ids[:prompt_len], seq.token_ids[prompt_len:] + list(extra),
                            seq.params, EOS)


def _batch() -> list[Sequence]:
    gen = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(1, VOCAB, (n,), generator=gen).tolist()

    return [
        _seq("a", ids(7), ids(12), PENALIZED),
        _seq("plain", ids(5), ids(3), SamplingParams()),  # no penalty: its row stays the model's
        _seq("migrated", ids(9), ids(2), PENALIZED, prior=4),  # its prompt ends with 4 earlier outputs
        _seq("min", ids(3), ids(1), SamplingParams(min_tokens=3, stop_token_ids=(5,), repetition_penalty=0.5)),
        _seq("bias", ids(4), [], SamplingParams(logit_bias={1: 2.5, 63: -7.0})),
    ]


def test_a_batch_matches_the_reference_row_by_row_and_unpenalized_rows_are_untouched():
    seqs = _batch()
    penalties = Penalties(VOCAB, EOS, torch.device("cpu"))
    logits = torch.randn(len(seqs), VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    out = penalties.adjusted(seqs, logits)
    for i, seq in enumerate(seqs):
        torch.testing.assert_close(out[i], _reference(logits[i], seq))
    torch.testing.assert_close(out[1], logits[1], rtol=0, atol=0)
    assert torch.isinf(out[3, [0, 5]]).all() and torch.isfinite(out[4, [0, 5]]).all()
    plain = logits[1:2]
    assert penalties.adjusted([seqs[1]], plain) is plain  # no penalized row: no work, no copy


def test_tokens_sampled_on_the_device_count_at_the_next_step_and_slots_are_reused():
    seqs = _batch()
    penalties = Penalties(VOCAB, EOS, torch.device("cpu"))
    gen = torch.Generator().manual_seed(2)
    for _ in range(4):
        logits = torch.randn(len(seqs), VOCAB, generator=gen)
        out = penalties.adjusted(seqs, logits)
        for i, seq in enumerate(seqs):
            torch.testing.assert_close(out[i], _reference(logits[i], seq))
        sampled = out.argmax(dim=1)
        penalties.record(seqs, sampled)  # on the device, as an overlapped step does
        for seq, token_id in zip(seqs, sampled.tolist()):
            seq.token_ids.append(PLACEHOLDER_TOKEN_ID)  # the scheduler's placeholder, resolved later
            seq.token_ids[-1] = token_id
    penalties.release(seqs[0])
    fresh = _seq("fresh", [2, 2, 4], [4], PENALIZED)  # takes the freed slot: nothing of seqs[0] left in it
    logits = torch.randn(1, VOCAB, generator=gen)
    torch.testing.assert_close(penalties.adjusted([fresh], logits)[0], _reference(logits[0], fresh))


def test_verification_rows_count_the_proposals_before_them():
    seqs = _batch()
    penalties = Penalties(VOCAB, EOS, torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    proposed = torch.randint(0, VOCAB, (len(seqs) + 1, 4), generator=gen)
    rows = [4, 0, 1, 2, 3]  # each sequence's row of the proposals
    lengths = [5, 3, 5, 2, 4]  # K + 1 rows verified (the budget may keep fewer)
    logits = [torch.randn(n, VOCAB, generator=gen) for n in lengths]
    out = penalties.adjusted_proposals(seqs, logits, proposed, rows)
    for seq, model, judged, row in zip(seqs, logits, out, rows):
        for j in range(model.shape[0]):
            torch.testing.assert_close(judged[j], _reference(model[j], seq, proposed[row, :j].tolist()))
    assert out[1] is logits[1]


# The engine on the real model ---------------------------------------------------------


def _run(engine: Engine, prompt: list[int], params: list[SamplingParams], prior: int = 0) -> list[list[int]]:
    """Each params' request on `prompt` to its end: its token ids."""
    ids = [engine.add_request(prompt, p, num_prior_output_tokens=prior) for p in params]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished:
        for delta in engine.step():
            tokens[delta.request_id] += delta.token_ids
    return [tokens[i] for i in ids]


def _hf_greedy(hf_model, prompt: list[int], params: SamplingParams, eos: tuple[int, ...]) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        for _ in range(params.max_tokens):
            logits = hf_model(torch.tensor([prompt + out])).logits[0, -1].float()
            out.append(int(reference_logits(logits, prompt, out, params, eos).argmax()))
            if out[-1] in eos:
                break
    return out


@pytest.fixture(scope="module")
def prompt(engine) -> list[int]:
    return engine.tokenize("List the colors of the rainbow, then list them again: red, orange,")


GREEDY = [
    SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3),
    SamplingParams(temperature=0.0, max_tokens=12, frequency_penalty=1.5, presence_penalty=0.8,
                   logit_bias={28: 4.0, 2575: -100.0}),
]


def test_greedy_with_penalties_is_the_references_with_and_without_speculation(engine, hf_model, prompt):
    eos = engine.arch.eos_token_ids
    expected = [_hf_greedy(hf_model, prompt, p, eos) for p in GREEDY]
    assert expected[0] != _hf_greedy(hf_model, prompt, SamplingParams(temperature=0.0, max_tokens=12), eos)
    plain = SamplingParams(temperature=0.0, max_tokens=12)
    assert _run(engine, prompt, [*GREEDY, plain])[:2] == expected  # mixed with an unpenalized row
    engine.speculate(SpecConfig(method="ngram", ngram_min=1, ngram_max=3, num_speculative_tokens=3))
    try:
        assert _run(engine, prompt, [*GREEDY, plain])[:2] == expected
        assert engine.speculator.metrics.num_passes > 0
    finally:
        engine.speculate(None)


def test_min_tokens_holds_off_eos_and_logprobs_are_the_models(engine, hf_model, prompt):
    eos = engine.arch.eos_token_ids[0]
    forced = {eos: 100.0}
    assert _run(engine, prompt, [SamplingParams(temperature=0.0, max_tokens=10, logit_bias=forced)]) == [[eos]]
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, logit_bias=forced, min_tokens=4,
                                                   logprobs=0))[0]
    assert len(out.token_ids) == 5 and out.token_ids[-1] == eos and eos not in out.token_ids[:4]
    with torch.no_grad():
        model = torch.log_softmax(hf_model(torch.tensor([prompt + out.token_ids])).logits[0].float(), dim=-1)
    for i, (token_id, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert lp.logprob == pytest.approx(float(model[len(prompt) - 1 + i, token_id]), abs=2e-3)


def test_sampled_tokens_follow_the_penalized_distribution(engine, hf_model):
    """One sampled position, its output counts from a continued request's earlier tokens (the
    prompt's last 6: " yellow, red, orange,"), against the reference distribution; the
    unpenalized one (" yellow" at 0.73) is refused."""
    prompt = engine.tokenize("Colors: red, orange, yellow, red, orange,")
    params = SamplingParams(temperature=1.0, max_tokens=1, repetition_penalty=1.4, frequency_penalty=1.2,
                            presence_penalty=0.5, logit_bias={11: 3.0})
    num_samples, prior = 500, 6
    out = _run(engine, prompt, [dataclasses.replace(params, seed=s) for s in range(num_samples)], prior)
    counts = torch.bincount(torch.tensor([t[0] for t in out]), minlength=engine.arch.vocab_size)
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0, -1].float()
    split = len(prompt) - prior
    expected = torch.softmax(reference_logits(logits, prompt[:split], prompt[split:], params, ()), dim=-1)
    assert chi_square_pvalue(counts, expected) > 1e-3
    assert chi_square_pvalue(counts, torch.softmax(logits, dim=-1)) < 1e-6


def test_the_grammar_masks_after_the_bias_and_preemption_keeps_the_counts(engine, make_engine, prompt):
    """A bias of +100 on a token the grammar forbids loses to the grammar's mask (applied last);
    a sequence preempted and recomputed keeps its history: the same greedy tokens as unpreempted."""
    import json

    from pdserve.engine.sampling import StructuredOutput

    letter = engine.tokenize("x")[0]
    schema = StructuredOutput.from_schema({"type": "object", "properties": {"a": {"type": "integer"}},
                                           "required": ["a"], "additionalProperties": False})
    constrained = SamplingParams(temperature=0.0, max_tokens=16, structured=schema, logit_bias={letter: 100.0},
                                 frequency_penalty=1.0)
    assert "a" in json.loads(engine.generate([prompt], constrained)[0].text)
    params = [dataclasses.replace(p, max_tokens=40) for p in GREEDY] * 2
    expected = _run(engine, prompt, params)
    small = make_engine(num_blocks=12, max_num_batched_tokens=64)  # 4 sequences of up to 60 tokens: preemptions
    assert _run(small, prompt, params) == expected
    assert small.scheduler.num_preemptions > 0
