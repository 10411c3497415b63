"""The lossless acceptance rule of speculative sampling, as pure batched functions.

Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative
Decoding") and Chen et al. 2023: a draft distribution q proposes, the target
distribution p decides, and every emitted token is distributed exactly as p.

Everything stays on the device: one verification step reads the results back once for
the whole batch, not once per sequence.
"""

from __future__ import annotations

import torch


def greedy_verify(draft_ids: torch.Tensor, num_proposed: torch.Tensor, target_ids: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule under a greedy target: keep proposals while they equal its argmax.

    Args:
        draft_ids: [m, k] int64, row i's first num_proposed[i] entries are its proposals.
        num_proposed: [m] int64.
        target_ids: [m, k + 1] int64, the target's argmax after the last token and after
            each proposal.

    Returns:
        num_accepted [m] int64, and token_ids [m, k + 1]: row i's first num_accepted[i] + 1
        entries are what it emits (the accepted proposals, then the target's token).
    """
    k = draft_ids.shape[1]
    positions = torch.arange(k, device=draft_ids.device)
    ok = (draft_ids == target_ids[:, :k]) & (positions[None, :] < num_proposed[:, None])
    num_accepted = ok.long().cumprod(dim=1).sum(dim=1)
    return num_accepted, _emitted(draft_ids, num_accepted, target_ids.gather(1, num_accepted[:, None])[:, 0])


def rejection_sample(draft_ids: torch.Tensor, num_proposed: torch.Tensor, draft_probs: torch.Tensor | None,
                     target_probs: torch.Tensor, uniforms: torch.Tensor, exponentials: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept a prefix of each row's draft tokens, then emit one token from the target.

    Args:
        draft_ids: [m, k] int64 proposed tokens x_1..x_k (row i's first num_proposed[i]).
        num_proposed: [m] int64.
        draft_probs: [m, k, vocab] float32, q_i that x_i was drawn from; None, or a row of
            zeros, when the drafter picked deterministically (q_i is one-hot on x_i: n-gram
            lookup, greedy drafting).
        target_probs: [m, k + 1, vocab] float32, p_i the target samples from at each
            proposed position, and after the last one (one-hot for greedy requests).
        uniforms: [m, k] U[0, 1) draws, one per proposal; exponentials: Exp(1) draws for the
            emitted token, [m, vocab], or [m, k + 1, vocab] with one per position (the row's
            token takes the one of the position it lands on, num_accepted[i]: a seeded
            request keys its draws by position).

    Returns:
        num_accepted [m] int64, and token_ids [m, k + 1]: row i emits its first
        num_accepted[i] + 1 entries.
    """
    m, k = draft_ids.shape
    device = draft_ids.device
    rows = torch.arange(m, device=device)
    p = target_probs[:, :k].gather(2, draft_ids[:, :, None])[:, :, 0]  # p_i(x_i)
    if draft_probs is None:
        q = torch.ones_like(p)
    else:
        q = draft_probs.gather(2, draft_ids[:, :, None])[:, :, 0]  # q_i(x_i)
        q = torch.where(draft_probs.sum(dim=2) > 0, q, 1.0)  # a zero row: deterministic
    # Accept x_i with probability min(1, p_i(x_i) / q_i(x_i)): u < p/q for u ~ U[0, 1),
    # written u * q < p so that nothing divides by zero and a token the target
    # gives probability 0 is never accepted. Under greedy p is one-hot, so this is
    # "accept iff x_i is the target's argmax" and the draws do not matter.
    ok = (uniforms * q < p) & (torch.arange(k, device=device)[None, :] < num_proposed[:, None])
    num_accepted = ok.long().cumprod(dim=1).sum(dim=1)

    # Every proposal accepted: the pass also gave p_{k+1} for free (the bonus token).
    # x_{n+1} rejected: draw from normalize(max(0, p - q)). Why this is exact:
    # P(emit y) = q(y) min(1, p(y)/q(y)) + P(reject) r(y)
    #           = min(p, q)(y) + (1 - sum min(p, q)) * max(0, p - q)(y) / sum max(0, p - q)
    # and sum max(0, p - q) = 1 - sum min(p, q), so P(emit y) = min(p, q)(y) + max(0, p - q)(y) = p(y).
    # With a one-hot q this is p with x_{n+1} removed; under greedy, the argmax.
    p_next = target_probs[rows, num_accepted]  # [m, vocab]
    rejected = num_accepted < num_proposed
    at = num_accepted.clamp(max=max(k - 1, 0))
    one_hot = torch.nn.functional.one_hot(draft_ids[rows, at], target_probs.shape[-1]).float() if k else p_next
    if draft_probs is None:
        q_next = one_hot
    else:
        q_next = draft_probs[rows, at]
        q_next = torch.where(q_next.sum(dim=1, keepdim=True) > 0, q_next, one_hot)
    residual = torch.where(rejected[:, None], (p_next - q_next).clamp_min(0.0), p_next)
    # p == q up to rounding: rejection had probability ~0; draw from p.
    residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p_next)
    # argmax(r / E) with E ~ Exp(1) is a draw from normalize(r) (the exponential race).
    if exponentials.dim() == 3:
        exponentials = exponentials[rows, num_accepted]
    token = (residual / exponentials).argmax(dim=1)
    return num_accepted, _emitted(draft_ids, num_accepted, token)


def _emitted(draft_ids: torch.Tensor, num_accepted: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """[m, k + 1]: the draft tokens with `token` written after the accepted ones."""
    out = torch.cat([draft_ids, torch.zeros_like(draft_ids[:, :1])], dim=1)
    return out.scatter_(1, num_accepted[:, None], token[:, None])
