"""Batched sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Log-probability (under the model, before temperature) of the sampled token and the top alternatives."""

    token_id: int
    logprob: float
    top_token_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    """Samples one token per row. Each seeded request owns a generator, so its
    draws do not depend on which other requests share the batch."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self._generator = torch.Generator(device=device).manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}

    def release(self, request_id: str) -> None:
        self._request_generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]) -> SamplerOutput:
        """logits: [N, vocab] float32, one row per request -> N token ids."""
        greedy_ids = logits.argmax(dim=-1)
        if all(p.greedy for p in params):
            token_ids = greedy_ids
        else:
            probs = self._filtered_probs(logits, params)
            noise = self._exponential_noise(probs.shape, request_ids, params)
            # argmax(p / E) with E ~ Exp(1) is a draw from p (the exponential race).
            sampled = (probs / noise).argmax(dim=-1)
            is_greedy = torch.tensor([p.greedy for p in params], device=logits.device)
            token_ids = torch.where(is_greedy, greedy_ids, sampled)
        ids = token_ids.tolist()
        return SamplerOutput(ids, _logprobs(logits, ids, params))

    def probs(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """The distribution `sample` draws from, for each row of one request's
        logits [N, vocab]: [N, vocab] float32, one-hot on the argmax when greedy.
        Speculative verification accepts draft tokens against it."""
        if params.greedy:
            return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
        return self._filtered_probs(logits, [params] * logits.shape[0])

    def generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        """The random stream a request draws from: its own when seeded, else the shared one."""
        if params.seed is None or params.greedy:
            return self._generator
        gen = self._request_generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
            self._request_generators[request_id] = gen
        return gen

    def logprobs(self, logits: torch.Tensor, token_ids: list[int], params: SamplingParams) -> list[TokenLogprobs]:
        """Logprobs of `token_ids[i]` under `logits[i]` for one request that asked for them."""
        out = _logprobs(logits, token_ids, [params] * len(token_ids))
        return [lp for lp in out if lp is not None]

    def _filtered_probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        device = logits.device
        temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=device)
        logits = logits / temps[:, None]
        if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
            logits = _apply_top_k_top_p_min_p(logits, params)
        return torch.softmax(logits, dim=-1)

    def _exponential_noise(self, shape: torch.Size, request_ids: list[str],
                           params: list[SamplingParams]) -> torch.Tensor:
        noise = torch.empty(shape, device=self.device).exponential_(generator=self._generator)
        for row, (rid, p) in enumerate(zip(request_ids, params)):
            if p.seed is not None and not p.greedy:
                noise[row].exponential_(generator=self.generator(rid, p))
        return noise


def _apply_top_k_top_p_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    device, vocab = logits.device, logits.shape[-1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    min_p = torch.tensor([p.min_p for p in params], device=device)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device)[None, :]
    drop = ranks >= top_k[:, None]
    probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token once the mass before it already reaches top_p (the first always stays).
    drop |= ((probs.cumsum(dim=-1) - probs) >= top_p[:, None]) & (top_p[:, None] < 1.0)
    drop |= probs < min_p[:, None] * probs[:, :1]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _logprobs(logits: torch.Tensor, token_ids: list[int], params: list[SamplingParams]) -> list[TokenLogprobs | None]:
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * len(params)
    if not rows:
        return out
    logp = torch.log_softmax(logits[rows], dim=-1)
    k = max(params[i].logprobs or 0 for i in rows)
    top_vals, top_ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    for j, i in enumerate(rows):
        n = params[i].logprobs or 0
        out[i] = TokenLogprobs(
            token_id=token_ids[i],
            logprob=logp[j, token_ids[i]].item(),
            top_token_ids=tuple(top_ids[j, :n].tolist()),
            top_logprobs=tuple(top_vals[j, :n].tolist()),
        )
    return out
