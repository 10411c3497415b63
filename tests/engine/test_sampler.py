"""Sampler against direct computations of the filtered distributions."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.sampler import Sampler
from pdserve.engine.sampling import SamplingParams

LOGITS = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
N = 20000


def frequencies(params: SamplingParams, logits: torch.Tensor = LOGITS, n: int = N) -> torch.Tensor:
    sampler = Sampler(seed=1, device=torch.device("cpu"))
    rows = logits.expand(n, -1).clone()
    out = sampler.sample(rows, [f"r{i}" for i in range(n)], [params] * n)
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
    out = sampler.sample(logits, [f"r{i}" for i in range(6)], params)
    for i in (0, 2, 4):
        assert out.token_ids[i] == logits[i].argmax().item()


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch():
    logits = torch.randn(1, 1000)
    seeded = SamplingParams(temperature=1.0, seed=1234)

    def draws(batch_extra: int) -> list[int]:
        sampler = Sampler(seed=batch_extra, device=torch.device("cpu"))
        got = []
        for _ in range(20):
            rows = torch.cat([torch.randn(batch_extra, 1000), logits])
            ids = [f"x{i}" for i in range(batch_extra)] + ["mine"]
            got.append(sampler.sample(rows, ids, [SamplingParams()] * batch_extra + [seeded]).token_ids[-1])
        return got

    assert draws(0) == draws(3) == draws(17)


def test_logprobs_are_the_model_distribution():
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    logits = torch.randn(2, 30)
    out = sampler.sample(logits, ["a", "b"], [SamplingParams(temperature=0.0, logprobs=3), SamplingParams()])
    lp = out.logprobs[0]
    ref = torch.log_softmax(logits[0], dim=-1)
    assert lp.token_id == out.token_ids[0]
    assert lp.logprob == pytest.approx(ref[lp.token_id].item(), abs=1e-6)
    assert list(lp.top_token_ids) == ref.topk(3).indices.tolist()
    assert out.logprobs[1] is None
