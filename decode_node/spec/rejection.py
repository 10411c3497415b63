"""The lossless acceptance rule of speculative sampling, as one pure function.

Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative
Decoding") and Chen et al. 2023: a draft distribution q proposes, the target
distribution p decides, and every emitted token is distributed exactly as p.
"""

from __future__ import annotations

import torch


def rejection_sample(draft_token_ids: list[int], draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                     generator: torch.Generator) -> list[int]:
    """Accept a prefix of the draft tokens, then emit one token from the target.

    Args:
        draft_token_ids: K proposed tokens x_1..x_K.
        draft_probs: [K, vocab] float32, q_i that x_i was drawn from; None when the
            drafter picked deterministically (q_i is one-hot on x_i: n-gram lookup,
            greedy drafting).
        target_probs: [K + 1, vocab] float32, p_i the target samples from at each
            proposed position, and p_{K+1} after the last one (one-hot when greedy).
        generator: the request's random stream.

    Returns:
        The accepted tokens x_1..x_n followed by one more token: 1 to K+1 tokens.
    """
    k = len(draft_token_ids)
    device = target_probs.device
    rows = torch.arange(k, device=device)
    ids = torch.tensor(draft_token_ids, dtype=torch.long, device=device)
    p = target_probs[rows, ids]  # p_i(x_i)
    q = torch.ones(k, device=device) if draft_probs is None else draft_probs[rows, ids]  # q_i(x_i)

    # Accept x_i with probability min(1, p_i(x_i) / q_i(x_i)): u < p/q for u ~ U[0, 1),
    # written u * q < p so that nothing divides by zero and a token the target
    # gives probability 0 is never accepted. Under greedy p is one-hot, so this is
    # "accept iff x_i is the target's argmax" and the draws do not matter.
    u = torch.rand(k, generator=generator, device=device)
    accepted = (u * q < p).tolist()
    n = accepted.index(False) if False in accepted else k

    if n == k:
        # Every proposal accepted: the pass also gave p_{K+1} for free (the bonus token).
        residual = target_probs[k]
    else:
        # x_{n+1} rejected: draw from normalize(max(0, p - q)). Why this is exact:
        # P(emit y) = q(y) min(1, p(y)/q(y)) + P(reject) r(y)
        #           = min(p, q)(y) + (1 - sum min(p, q)) * max(0, p - q)(y) / sum max(0, p - q)
        # and sum max(0, p - q) = 1 - sum min(p, q), so P(emit y) = min(p, q)(y) + max(0, p - q)(y) = p(y).
        # With a one-hot q this is p with x_{n+1} removed; under greedy, the argmax.
        q_row = (torch.nn.functional.one_hot(ids[n], target_probs.shape[-1]).float()
                 if draft_probs is None else draft_probs[n])
        residual = (target_probs[n] - q_row).clamp_min(0.0)
        if residual.sum() <= 0:  # p == q up to rounding: rejection had probability ~0
            residual = target_probs[n]
    token = int(torch.multinomial(residual, 1, generator=generator).item())
    return list(draft_token_ids[:n]) + [token]
