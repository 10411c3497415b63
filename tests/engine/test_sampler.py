"""Sampler against direct computations of the filtered distributions."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.sampler import Sampler, keyed_seed
from pdserve.engine.sampling import SamplingParams

LOGITS = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
N = 20000


def frequencies(params: SamplingParams, logits: torch.Tensor = LOGITS, n: int = N) -> torch.Tensor:
    sampler = Sampler(seed=1, device=torch.device("cpu"))
    rows = logits.expand(n, -1).clone()
    out = sampler.sample(rows, [params] * n, [0] * n)
    return torch.bincount(torch.tensor(out.token_ids), minlength=logits.numel()).float() / n


@pytest.mark.parametrize("params, expected", [
    (SamplingParams(temperature=1.0), [0.5, 0.3, 0.15, 0.05]),
    (SamplingParams(temperature=1.0, top_k=2), [0.625, 0.375, 0.0, 0.0]),
    (SamplingParams(temperature=1.0, top_p=0.8), [0.625, 0.375, 0.0, 0.0]),
    (SamplingParams(temperature=1.0, top_p=0.81), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
    (SamplingParams(temperature=1.0, min_p=0.4), [0.625, 0.375, 0.0, 0.0]),
    (SamplingParams(temperature=2.0), (torch.tensor([0.5, 0.3, 0.15, 0.05]) ** 0.5
                                       / (torch.tensor([0.5, 0.3, 0.15, 0.05]) ** 0.5).sum()).tolist()),
])
def test_sampled_frequencies_follow_the_filtered_distribution(params, expected):
    freq = frequencies(params)
    expected = torch.tensor(expected)
    assert torch.all(freq[expected == 0] == 0), f"filtered-out tokens were sampled: {freq}"
    # 5 standard errors of a binomial proportion at N draws.
    tol = 5 * (expected * (1 - expected) / N).sqrt() + 1e-9
    assert torch.all((freq - expected).abs() <= tol), f"{freq} vs {expected}"


def test_greedy_rows_take_the_argmax_beside_sampled_rows():
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    logits = torch.randn(6, 50)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 3
    out = sampler.sample(logits, params, [0] * 6)
    for i in (0, 2, 4):
        assert out.token_ids[i] == logits[i].argmax().item()


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch():
    logits = torch.randn(1, 1000)
    seeded = SamplingParams(temperature=1.0, seed=1234)

    def draws(batch_extra: int) -> list[int]:
        sampler = Sampler(seed=batch_extra, device=torch.device("cpu"))
        got = []
        for j in range(20):
            rows = torch.cat([torch.randn(batch_extra, 1000), logits])
            indices = [j + 5] * batch_extra + [j]
            got.append(sampler.sample(rows, [SamplingParams()] * batch_extra + [seeded], indices).token_ids[-1])
        return got

    assert draws(0) == draws(3) == draws(17)


def test_a_seeded_draw_depends_only_on_the_seed_and_the_token_index():
    """What lets a prefill worker, a decode worker and a migrated request's new worker draw
    what one engine would: no state carries from one token to the next."""
    logits = torch.randn(1, 1000)
    seeded = SamplingParams(temperature=1.0, seed=99)
    one = Sampler(seed=0, device=torch.device("cpu"))
    in_order = [one.sample(logits, [seeded], [j]).token_ids[0] for j in range(30)]
    other = Sampler(seed=5, device=torch.device("cpu"))
    backwards = {}
    for j in reversed(range(30)):  # in a batch beside unseeded rows and the same seed's other index
        rows = torch.cat([torch.randn(2, 1000), logits, logits])
        out = other.sample(rows, [SamplingParams()] * 2 + [seeded, seeded], [0, 0, j, j + 1])
        backwards[j] = out.token_ids[2]
    assert [backwards[j] for j in range(30)] == in_order
    assert len(set(in_order)) > 10  # each index draws afresh (1000 near-equal logits)
    uniform = one.noise((1, 4), [seeded], [3], "uniform")
    assert not torch.equal(uniform, one.noise((1, 4), [seeded], [3], "uniform", stream="draft"))
    assert not torch.equal(uniform, one.noise((1, 4), [seeded], [4], "uniform"))
    assert torch.equal(uniform, one.noise((1, 4), [seeded], [3], "uniform"))


def test_keyed_seeds_of_neighbouring_seeds_and_indices_differ():
    keys = {keyed_seed(s, j, salt) for s in range(-3, 20) for j in range(20) for salt in range(3)}
    assert len(keys) == 23 * 20 * 3 and all(0 <= k < 2**63 for k in keys)


def test_logprobs_are_the_model_distribution():
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    logits = torch.randn(2, 30)
    out = sampler.sample(logits, [SamplingParams(temperature=0.0, logprobs=3), SamplingParams()], [0, 0])
    lp = out.logprobs[0]
    ref = torch.log_softmax(logits[0], dim=-1)
    assert lp.token_id == out.token_ids[0]
    assert lp.logprob == pytest.approx(ref[lp.token_id].item(), abs=1e-6)
    assert list(lp.top_token_ids) == ref.topk(3).indices.tolist()
    assert out.logprobs[1] is None


def test_logprobs_of_mixed_rows_carry_ranks_and_alternatives():
    """Rows asking for different numbers of alternatives (or none) in one batch: each gets its
    token's log-probability, its rank (1 + the tokens likelier) and its own top entries;
    `Sampler.logprobs` (the verified tokens' path) gives the same for given tokens."""
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(temperature=1.0, logprobs=2), SamplingParams(),
              SamplingParams(temperature=1.0, logprobs=0)]
    out = sampler.sample(logits, params, [0, 0, 0])
    ref = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[1] is None
    for row, num_top in ((0, 2), (2, 0)):
        lp, token = out.logprobs[row], out.token_ids[row]
        assert lp.token_id == token and lp.logprob == pytest.approx(ref[row, token].item(), abs=1e-6)
        assert lp.rank == int((ref[row] > ref[row, token]).sum()) + 1
        assert list(lp.top_token_ids) == ref[row].topk(num_top).indices.tolist()
        assert list(lp.top_logprobs) == pytest.approx(ref[row].topk(num_top).values.tolist(), abs=1e-6)
    tokens = [int(ref[0].argsort()[-7]), int(ref[1].argmax())]  # ranks 7 and 1
    given = sampler.logprobs(logits[:2], tokens, SamplingParams(logprobs=1))
    assert [g.rank for g in given] == [7, 1]
    assert [g.logprob for g in given] == pytest.approx([ref[0, tokens[0]].item(), ref[1, tokens[1]].item()], abs=1e-6)
    assert [g.top_token_ids for g in given] == [(int(ref[0].argmax()),), (tokens[1],)]
