"""The acceptance rule on synthetic distributions: greedy is exact, sampling keeps p."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.speculative.rejection import greedy_verify, rejection_sample
from tests.engine.speculative.stats import chi_square_pvalue, resample_from_target

VOCAB = 8


def _dist(*weights: float) -> torch.Tensor:
    w = torch.tensor(weights, dtype=torch.float32)
    return w / w.sum()


# Target and draft far apart, so a wrong rule shows.
P = torch.stack([_dist(8, 4, 2, 1, 1, 1, 1, 1), _dist(1, 1, 1, 1, 1, 2, 4, 8), _dist(1, 3, 1, 3, 1, 3, 1, 3)])
Q = torch.stack([_dist(1, 1, 1, 1, 2, 4, 8, 8), _dist(8, 4, 2, 1, 1, 1, 1, 1)])


def _one(draft: list[int], q: torch.Tensor | None, p: torch.Tensor, gen: torch.Generator) -> list[int]:
    """The batched rule on one sequence: what it emits."""
    k = len(draft)
    uniforms = torch.rand((1, k), generator=gen)
    exponentials = torch.empty((1, p.shape[-1])).exponential_(generator=gen)
    n, tokens = rejection_sample(torch.tensor([draft]), torch.tensor([k]), None if q is None else q[None],
                                 p[None], uniforms, exponentials)
    return tokens[0, :int(n[0]) + 1].tolist()


def test_batched_rows_are_judged_independently_and_only_up_to_their_proposals():
    target = _greedy(P)  # argmaxes 0, 7, 1
    draft = torch.tensor([[0, 7], [0, 3], [5, 7], [0, 7]])
    counts = torch.tensor([2, 2, 2, 1])
    n, tokens = greedy_verify(draft, counts, target.argmax(-1).expand(4, 3))
    assert n.tolist() == [2, 1, 0, 1]
    assert [row[:k + 1] for row, k in zip(tokens.tolist(), n.tolist())] == [[0, 7, 1], [0, 7], [0], [0, 7]]
    gen = torch.Generator().manual_seed(0)
    n2, tokens2 = rejection_sample(draft, counts, None, target.expand(4, 3, VOCAB), torch.rand((4, 2), generator=gen),
                                   torch.empty((4, VOCAB)).exponential_(generator=gen))
    assert n2.tolist() == n.tolist() and tokens2.tolist() == tokens.tolist()


def _greedy(probs: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.one_hot(probs.argmax(-1), VOCAB).float()


def test_greedy_accepts_exactly_the_target_argmax_prefix():
    target = _greedy(P)  # argmaxes 0, 7, 1
    gen = torch.Generator().manual_seed(0)
    assert _one([0, 7], None, target, gen) == [0, 7, 1]
    assert _one([0, 3], None, target, gen) == [0, 7]
    assert _one([5, 7], None, target, gen) == [0]
    # A sampled draft (q not one-hot) changes nothing under a greedy target.
    assert _one([0, 6], Q, target, gen) == [0, 7]


def _emitted(rule, num_samples: int, one_hot_draft: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts of the first and second emitted token over seeded runs of `rule`."""
    first, second = torch.zeros(VOCAB), torch.zeros(VOCAB)
    for seed in range(num_samples):
        gen = torch.Generator().manual_seed(seed)
        draft = [int(torch.multinomial(Q[i], 1, generator=gen)) for i in range(2)]
        out = _one(draft, None if one_hot_draft else Q, P, gen) if rule is None else \
            rule(draft, None if one_hot_draft else Q, P, gen)
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    return first, second


@pytest.mark.parametrize("one_hot_draft", [False, True], ids=["sampled-draft", "deterministic-draft"])
def test_sampling_keeps_the_target_distribution(one_hot_draft):
    first, second = _emitted(None, 4000, one_hot_draft)
    assert chi_square_pvalue(first, P[0]) > 1e-3
    # The second token exists only after the first was accepted (x_1 drawn from
    # Q[0] and kept): it is then distributed as P[1] whatever x_1 was.
    assert chi_square_pvalue(second, P[1]) > 1e-3


def _accept_always(draft, q, p, gen):
    return list(draft) + [int(torch.multinomial(p[len(draft)], 1, generator=gen))]


@pytest.mark.parametrize("rule", [_accept_always, resample_from_target])
def test_the_statistical_test_rejects_a_broken_rule(rule):
    first, _ = _emitted(rule, 4000, one_hot_draft=False)
    assert chi_square_pvalue(first, P[0]) < 1e-6
