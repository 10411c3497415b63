"""Batched sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from pdserve.engine.sampling import SamplingParams
from pdserve.kernels.sampling import gumbel_argmax

Kind = Literal["uniform", "exponential"]
Stream = Literal["target", "draft"]
# One independent family of numbers per (kind, stream) of a seeded request's token.
_SALTS = {("exponential", "target"): 1, ("uniform", "target"): 2, ("exponential", "draft"): 3,
          ("uniform", "draft"): 4}
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Log-probability (under the model, before temperature) of a token (sampled, or a prompt's)
    and the top alternatives; `rank`: 1 + how many tokens the model found likelier (vLLM's)."""

    token_id: int
    logprob: float
    top_token_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]
    rank: int


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


@dataclass(slots=True)
class HostCopy:
    """A device tensor on its way to pinned host memory: `get` waits for it and the GPU work
    queued before it, not for what the stream runs after."""

    _host: torch.Tensor
    _ready: torch.cuda.Event | None

    @classmethod
    def of(cls, t: torch.Tensor) -> HostCopy:
        on_gpu = t.device.type == "cuda"
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=on_gpu)
        host.copy_(t, non_blocking=on_gpu)
        ready = None
        if on_gpu:
            ready = torch.cuda.Event()
            ready.record()
        return cls(host, ready)

    def get(self) -> torch.Tensor:
        if self._ready is not None:
            self._ready.synchronize()
        return self._host


@dataclass(slots=True)
class PendingSample:
    """Sampled ids still on their way from the GPU: `token_ids` stays on the device (a next
    step can read it there), the host copies land in pinned memory."""

    token_ids: torch.Tensor  # [N] int64, on the sampler's device
    _host_ids: HostCopy
    _logprobs: _PendingLogprobs | None

    def resolve(self) -> SamplerOutput:
        """Wait for the copies (the step's GPU work before them) and read them."""
        ids = self._host_ids.get().tolist()
        lp = self._logprobs.resolve(ids) if self._logprobs is not None else [None] * len(ids)
        return SamplerOutput(ids, lp)


@dataclass(slots=True)
class _PendingLogprobs:
    """The log-probabilities of a step's rows on their way to the host, one copy: row j of
    `values` is [logprob of the token, its rank, the top ids, the top logprobs] (ids and ranks
    exact in float32 below 2**24). `resolve` waits for that copy (`HostCopy.get`): a pinned
    host tensor read before its copy lands holds whatever the memory held before (issue 52:
    verified tokens' log-probabilities were read that way, unsynchronized, and came out of
    another step)."""

    rows: list[int]  # batch rows that asked for logprobs
    num_top: list[int]  # how many alternatives each of them wants
    values: HostCopy  # [len(rows), 2 + 2 * max num_top] float32

    def resolve(self, token_ids: list[int]) -> list[TokenLogprobs | None]:
        out: list[TokenLogprobs | None] = [None] * len(token_ids)
        values = self.values.get().tolist()
        for i, n, v in zip(self.rows, self.num_top, values):
            k = (len(v) - 2) // 2
            out[i] = TokenLogprobs(token_ids[i], v[0], tuple(int(t) for t in v[2:2 + n]),
                                   tuple(v[2 + k:2 + k + n]), int(v[1]))
        return out


class Sampler:
    """Samples one token per row. A seeded request's random numbers for output token j are a
    function of (seed, j) alone (`keyed_seed`), so that its tokens depend neither on the
    batch nor on which process samples which token: a prefill worker's first token, a decode
    worker's next ones, a migrated request's re-prefill or a recompute after preemption all
    draw what one engine alone would have drawn."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self._generator = torch.Generator(device=device).manual_seed(seed)
        self._keyed = torch.Generator(device=device)  # re-seeded for every seeded draw

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], token_indices: list[int]) -> SamplerOutput:
        """logits: [N, vocab] float32, one row per request -> N token ids. token_indices[i]:
        the output index the token of row i will have (`Sequence.next_output_index`)."""
        return self.sample_async(logits, params, token_indices).resolve()

    def sample_async(self, logits: torch.Tensor, params: list[SamplingParams], token_indices: list[int],
                     model_logits: torch.Tensor | None = None) -> PendingSample:
        """`sample` without waiting for the GPU: everything is queued on the current stream.
        model_logits: what the log-probabilities are of, when `logits` were changed from them
        (penalties and bias: `engine.penalties`); None: `logits`."""
        token_ids, _ = self.draw(logits, params, token_indices)
        pending_lp = _logprobs_async(logits if model_logits is None else model_logits, token_ids, params)
        return PendingSample(token_ids, HostCopy.of(token_ids), pending_lp)

    def draw(self, logits: torch.Tensor, params: list[SamplingParams], token_indices: list[int],
             with_probs: bool = False, stream: Stream = "target") -> tuple[torch.Tensor, torch.Tensor | None]:
        """One token per row of logits [N, vocab], on the device, nothing read back: [N] int64,
        and (with_probs, or when some row samples on the torch path) the distributions they
        were drawn from, [N, vocab] float32, one-hot on greedy rows. token_indices and
        stream: which of a seeded row's draws this is (see `noise`). On CUDA, rows that only
        need a temperature (no top-k/top-p/min-p, no seed of their own) are drawn in one
        pass over the logits (`kernels.gumbel_argmax`), from a seed the shared generator
        draws on the device; on the CPU, by one uniform each (`_inverse_cdf`)."""
        if all(p.greedy for p in params) and not with_probs:
            return logits.argmax(dim=-1), None
        if not with_probs and all(_plain(p) for p in params):
            if not logits.is_cuda:
                return self._inverse_cdf(logits, params), None
            temps = on_device([0.0 if p.greedy else p.temperature for p in params], torch.float32, logits.device)
            seed = torch.randint(0, 2**62, (1,), device=logits.device, generator=self._generator)
            return gumbel_argmax(logits, temps, seed), None
        greedy_ids = logits.argmax(dim=-1)
        if all(p.greedy for p in params):
            return greedy_ids, torch.nn.functional.one_hot(greedy_ids, logits.shape[-1]).float()
        probs = self._filtered_probs(logits, params)
        noise = self.noise(probs.shape, params, token_indices, "exponential", stream)
        # argmax(p / E) with E ~ Exp(1) is a draw from p (the exponential race).
        sampled = (probs / noise).argmax(dim=-1)
        is_greedy = on_device([p.greedy for p in params], torch.bool, logits.device)
        token_ids = torch.where(is_greedy, greedy_ids, sampled)
        if any(p.greedy for p in params):
            one_hot = torch.nn.functional.one_hot(greedy_ids, logits.shape[-1]).float()
            probs = torch.where(is_greedy[:, None], one_hot, probs)
        return token_ids, probs

    def _inverse_cdf(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """One draw per row of logits [N, vocab] at its temperature (argmax on greedy rows), on
        the CPU: the first entry whose cumulative probability passes one uniform of the
        shared generator (entries of probability 0 are never drawn). One random number a
        row, where the exponential race takes one per vocabulary entry (a third of a CPU
        decode step's time at batch 32 on the default model)."""
        cdf = self._filtered_probs(logits, params).cumsum_(dim=-1)
        u = torch.rand((logits.shape[0], 1), generator=self._generator, device=logits.device) * cdf[:, -1:]
        token_ids = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=logits.shape[-1] - 1)
        if any(p.greedy for p in params):
            is_greedy = on_device([p.greedy for p in params], torch.bool, logits.device)
            token_ids = torch.where(is_greedy, logits.argmax(dim=-1), token_ids)
        return token_ids

    def filtered_probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """softmax of each row of logits [N, vocab] after row i's temperature, top-k, top-p
        and min-p (greedy rows at temperature 1: callers take their argmax instead)."""
        return self._filtered_probs(logits, params)

    def noise(self, shape: torch.Size | tuple[int, ...], params: list[SamplingParams], token_indices: list[int],
              kind: Kind, stream: Stream = "target") -> torch.Tensor:
        """Random numbers [N, ...] ("uniform": U[0, 1), or "exponential": Exp(1)). Row i of a
        seeded request is a function of (its seed, token_indices[i], kind, stream) only: the
        output index of the token it is for, and what it is for there ("target": the token
        itself or its acceptance, "draft": a drafter's proposal), so that no two uses share
        numbers. Other rows come from the shared generator."""
        noise = torch.empty(shape, device=self.device)
        _fill(noise, kind, self._generator)
        for row, (p, index) in enumerate(zip(params, token_indices, strict=True)):
            if p.seed is not None and not p.greedy:
                self._keyed.manual_seed(keyed_seed(p.seed, index, _SALTS[kind, stream]))
                _fill(noise[row], kind, self._keyed)
        return noise

    def logprobs(self, logits: torch.Tensor, token_ids: list[int], params: SamplingParams) -> list[TokenLogprobs]:
        """Logprobs of `token_ids[i]` under `logits[i]` for one request that asked for them."""
        out = _logprobs(logits, token_ids, [params] * len(token_ids))
        return [lp for lp in out if lp is not None]

    def _filtered_probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        device = logits.device
        temps = on_device([p.temperature if p.temperature > 0 else 1.0 for p in params], torch.float32, device)
        logits = logits / temps[:, None]
        if any(_filters(p) for p in params):
            logits = _apply_top_k_top_p_min_p(logits, params)
        return torch.softmax(logits, dim=-1)


def _filters(p: SamplingParams) -> bool:
    """Whether top-k, top-p or min-p cut the row's distribution."""
    return p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0


def _plain(p: SamplingParams) -> bool:
    """Drawn at its temperature alone, from the shared stream (or greedy)."""
    return p.greedy or (p.seed is None and not _filters(p))


def keyed_seed(seed: int, token_index: int, salt: int = 0) -> int:
    """A generator seed in [0, 2**63) that is a well-mixed function of (seed, token_index,
    salt): nearby seeds and indices give unrelated streams (splitmix64's finalizer, chained)."""
    x = _splitmix64(seed & _MASK64)
    x = _splitmix64(x ^ (token_index & _MASK64))
    return _splitmix64(x ^ salt) >> 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _fill(t: torch.Tensor, kind: str, generator: torch.Generator) -> None:
    if kind == "uniform":
        t.uniform_(generator=generator)
    else:
        t.exponential_(generator=generator)


def _apply_top_k_top_p_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    device, vocab = logits.device, logits.shape[-1]
    top_k = on_device([p.top_k if p.top_k > 0 else vocab for p in params], torch.int64, device)
    top_p = on_device([p.top_p for p in params], torch.float32, device)
    min_p = on_device([p.min_p for p in params], torch.float32, device)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device)[None, :]
    drop = ranks >= top_k[:, None]
    probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token once the mass before it already reaches top_p (the first always stays).
    drop |= ((probs.cumsum(dim=-1) - probs) >= top_p[:, None]) & (top_p[:, None] < 1.0)
    drop |= probs < min_p[:, None] * probs[:, :1]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def on_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on `device` without waiting for the GPU (a plain `torch.tensor(...,
    device=cuda)` synchronizes the stream: the step's whole forward)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _logprobs(logits: torch.Tensor, token_ids: list[int], params: list[SamplingParams]) -> list[TokenLogprobs | None]:
    ids = torch.tensor(token_ids, dtype=torch.long, device=logits.device)
    pending = _logprobs_async(logits, ids, params)
    return pending.resolve(token_ids) if pending is not None else [None] * len(token_ids)


def _logprobs_async(logits: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams]
                    ) -> _PendingLogprobs | None:
    """Logprobs of the rows that asked for them, computed on the device; read at resolve."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return None
    index = on_device(rows, torch.int64, logits.device)
    logp = torch.log_softmax(logits.index_select(0, index), dim=-1)
    num_top = [params[i].logprobs or 0 for i in rows]
    k = max(num_top)
    chosen = logp.gather(1, token_ids.index_select(0, index)[:, None])
    values = torch.empty((len(rows), 2 + 2 * k), dtype=torch.float32, device=logits.device)
    values[:, :1] = chosen
    values[:, 1] = (logp > chosen).sum(dim=-1) + 1
    if k:
        top_vals, top_ids = logp.topk(k, dim=-1)
        values[:, 2:2 + k] = top_ids
        values[:, 2 + k:] = top_vals
    return _PendingLogprobs(rows, num_top, HostCopy.of(values))
