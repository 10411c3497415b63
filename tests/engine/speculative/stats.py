"""Pearson's chi-square goodness-of-fit test, without scipy, and a broken acceptance rule
that the distribution tests must catch."""

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


def resample_from_target(draft, q, p, gen):
    """The classic bug: on rejection draw from p instead of normalize(max(0, p - q))."""
    for i, x in enumerate(draft):
        qx = 1.0 if q is None else float(q[i, x])
        if float(torch.rand((), generator=gen)) * qx >= float(p[i, x]):
            return list(draft[:i]) + [int(torch.multinomial(p[i], 1, generator=gen))]
    return list(draft) + [int(torch.multinomial(p[len(draft)], 1, generator=gen))]


def resample_from_target_batched(draft_ids, num_proposed, draft_probs, target_probs, uniforms, exponentials):
    """`resample_from_target` in the batched form of `engine.speculative.rejection.rejection_sample`."""
    m, k = draft_ids.shape
    rows = torch.arange(m)
    p = target_probs[:, :k].gather(2, draft_ids[:, :, None])[:, :, 0]
    q = torch.ones_like(p) if draft_probs is None else draft_probs.gather(2, draft_ids[:, :, None])[:, :, 0]
    ok = (uniforms * q < p) & (torch.arange(k)[None, :] < num_proposed[:, None])
    n = ok.long().cumprod(dim=1).sum(dim=1)
    rows = rows.to(n.device)
    if exponentials.dim() == 3:  # one draw per position (seeded rows)
        exponentials = exponentials[rows, n]
    token = (target_probs[rows, n] / exponentials).argmax(dim=1)
    out = torch.cat([draft_ids, torch.zeros_like(draft_ids[:, :1])], dim=1)
    return n, out.scatter_(1, n[:, None], token[:, None])
