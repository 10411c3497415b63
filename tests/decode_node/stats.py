"""Pearson's chi-square goodness-of-fit test, without scipy."""

from __future__ import annotations

import torch


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """P-value of observing `counts` if they were drawn from `probs`.

    Cells expected to hold fewer than `min_expected` samples are pooled into one,
    where the chi-square approximation would be poor.
    """
    counts = counts.double()
    expected = probs.double() / probs.sum() * counts.sum()
    small = expected < min_expected
    obs = torch.cat([counts[~small], counts[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    if not small.any():
        obs, exp = obs[:-1], exp[:-1]
    stat = ((obs - exp) ** 2 / exp.clamp_min(1e-12)).sum()
    dof = len(obs) - 1
    # The chi-square survival function is the regularized upper incomplete gamma.
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2.0))
