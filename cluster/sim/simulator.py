"""A discrete-event simulation of a pdserve cluster: router, prefill pool, KV transfer, decode
pool with continuous batching (or colocated workers doing both), from measured step costs.

Why a simulator: the planner must compare pool splits it cannot try (DistServe chose its
placements the same way), and an operator wants to size a 1,000-GPU cluster from what two
workers measured. So it is pure Python, deterministic for a seed, and O(events log events):
an event is an arrival, a KV landing or one worker's step; a decode step never touches its
sequences one by one (each running sequence's last step is known when it joins, so a heap
keyed by that step retires them, and the batch's total context grows by the batch size).

The model, as the engine and the coordinator work:
- a request goes to the prefill worker with the fewest queued prompt tokens (the router's
  load term); a decode worker is picked when its prompt is done, by fewest sequences;
- a worker's step takes, under `max_num_batched_tokens`, one token per running sequence and
  then prompt chunks first come, first served; it costs the decode step of its batch plus
  each chunk's share of its prompt's prefill curve (plus the prefill overhead when it has no
  decodes); the prompt's last chunk gives its first token (TTFT) at the step's end;
- disaggregated, the KV then moves (`kv_transfer_s`) and the sequence joins the decode
  worker's batch at its next step, seats (`max_num_seqs`) permitting; colocated, a prompt
  takes its seat when its first chunk runs, and joins its worker's batch at once.
ITL is every gap between a request's tokens (the first decode token's gap includes the
transfer and the wait for a seat), as `pdserve bench` measures it. The profile's serving
overheads of the split's setup (`StepCosts.overheads_s`: what a served request waits besides
the engine's steps, disaggregated or colocated) are added to each TTFT and each gap.
"""

from __future__ import annotations

import collections
import heapq
import math
import random
from dataclasses import dataclass, field

from pdserve.cluster.sim.slo import Slo
from pdserve.cluster.sim.step_costs import StepCosts

_ARRIVE, _LAND, _STEP = 0, 1, 2


@dataclass(frozen=True, slots=True)
class Lengths:
    """Token counts drawn uniformly from mean·(1 − spread) .. mean·(1 + spread), at least 1."""

    mean: int
    spread: float = 0.0

    def __post_init__(self) -> None:
        if self.mean < 1 or not 0.0 <= self.spread < 1.0:
            raise ValueError(f"lengths need mean >= 1 and spread in [0, 1), got {self.mean}, {self.spread}")

    def draw(self, rng: random.Random) -> int:
        if not self.spread:
            return self.mean
        lo, hi = self.mean * (1 - self.spread), self.mean * (1 + self.spread)
        return max(1, round(rng.uniform(lo, hi)))


@dataclass(frozen=True, slots=True)
class Traffic:
    """A traffic mix: `num_requests` arriving at `rate_per_s` (Poisson, or evenly spaced)."""

    rate_per_s: float
    prompt: Lengths
    output: Lengths
    num_requests: int = 1000
    poisson: bool = True

    def __post_init__(self) -> None:
        if not (self.rate_per_s > 0 and math.isfinite(self.rate_per_s)) or self.num_requests < 1:
            raise ValueError(f"traffic needs a finite rate > 0 and >= 1 request, got {self.rate_per_s}, "
                             f"{self.num_requests}")


@dataclass(frozen=True, slots=True)
class Split:
    """A cluster's workers: disaggregated (prefill + decode) or colocated (`num_decode` mixed)."""

    num_prefill: int
    num_decode: int

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ValueError(f"a split needs >= 1 decode worker, got {self.num_prefill}P/{self.num_decode}D")

    @property
    def colocated(self) -> bool:
        return self.num_prefill == 0

    def __str__(self) -> str:
        return f"{self.num_decode} colocated" if self.colocated else f"{self.num_prefill}P/{self.num_decode}D"


@dataclass(frozen=True, slots=True)
class Prediction:
    """What a run predicts, ms and requests/s."""

    split: Split
    num_requests: int
    ttft_ms: dict[int, float]  # percentile -> ms
    itl_ms: dict[int, float]  # over every gap between tokens
    tpot_ms: dict[int, float]  # each request's mean gap
    duration_s: float  # first arrival to last token
    attainment: float  # share of requests meeting the SLO
    goodput: float  # requests meeting the SLO per second


PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class _Request:
    rid: int
    arrival: float
    prompt: int
    output: int
    first_token: float = 0.0
    finish: float = 0.0
    first_gap: float = 0.0  # first token to the second


@dataclass(slots=True)
class _Worker:
    index: int
    is_prefill: bool  # of the prefill pool (else decode or mixed)
    queue: collections.deque[_Request] = field(default_factory=collections.deque)  # prompts to compute
    head_done: int = 0  # tokens of queue[0] computed
    queued_tokens: int = 0  # prompt tokens not yet computed (those of the step running now included)
    chunked: int = 0  # prompt tokens the step running now computes
    landed: collections.deque[tuple[_Request, int]] = field(default_factory=collections.deque)  # (req, tokens to go)
    running: list[tuple[int, int, _Request]] = field(default_factory=list)  # heap (last step, rid, req)
    num_assigned: int = 0  # decode: sequences sent here and not finished
    context: int = 0  # tokens the running sequences hold
    steps: int = 0
    step_ends: list[float] = field(default_factory=lambda: [0.0])  # step_ends[n]: when step n ended
    busy: bool = False
    joined: list[_Request] = field(default_factory=list)  # joined the batch at the step running now
    prompts_done: list[_Request] = field(default_factory=list)  # whose last chunk the step running now computes


class _LeastLoaded:
    """The worker with the smallest load: a heap with stale entries skipped (O(log n) a change)."""

    def __init__(self, num: int) -> None:
        self.load = [(0, 0)] * num
        self.heap = [((0, 0), i) for i in range(num)]

    def set(self, w: _Worker) -> None:
        load = (w.queued_tokens, w.num_assigned)  # prompt work first, then sequences held
        self.load[w.index] = load
        heapq.heappush(self.heap, (load, w.index))

    def best(self) -> int:
        while True:
            load, i = self.heap[0]
            if self.load[i] == load:
                return i
            heapq.heappop(self.heap)


class _Run:
    def __init__(self, costs: StepCosts, split: Split) -> None:
        self.costs = costs
        self.split = split
        self.events: list[tuple[float, int, int, int, object]] = []
        self.seq = 0
        self.prefill = [_Worker(i, True) for i in range(split.num_prefill)]
        self.decode = [_Worker(i, False) for i in range(split.num_decode)]
        self.prefill_load = _LeastLoaded(split.num_prefill or split.num_decode)
        self.decode_load = _LeastLoaded(split.num_decode)
        self.itl_steps: list[tuple[float, int]] = []  # (a step's duration, its sequences past their first gap)
        self.done: list[_Request] = []

    def push(self, t: float, kind: int, index: int, payload: object = None) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, index, payload))

    def run(self, requests: list[_Request]) -> None:
        for r in requests:
            self.push(r.arrival, _ARRIVE, 0, r)
        while self.events:
            t, _, kind, index, payload = heapq.heappop(self.events)
            if kind == _ARRIVE:
                self.arrive(t, payload)  # type: ignore[arg-type]
            elif kind == _LAND:
                w = self.decode[index]
                w.landed.append((payload, payload.output - 1))  # type: ignore[union-attr]
                self.start_step(w, t)
                self.decode_load.set(w)
            else:
                self.end_step(self.prefill[index] if payload else self.decode[index], t)

    def arrive(self, t: float, r: _Request) -> None:
        pool = self.prefill if self.prefill else self.decode
        w = pool[self.prefill_load.best()]
        w.queue.append(r)
        w.queued_tokens += r.prompt
        w.num_assigned += not w.is_prefill
        self.prefill_load.set(w)
        self.start_step(w, t)

    def start_step(self, w: _Worker, t: float) -> None:
        if w.busy:
            return
        c = self.costs
        while w.landed and len(w.running) < c.max_num_seqs:
            r, to_go = w.landed.popleft()
            if to_go <= 0:  # one output token: done with its first
                self.finish(w, r, r.first_token)
                continue
            heapq.heappush(w.running, (w.steps + to_go, r.rid, r))
            w.context += r.prompt + 1
            w.joined.append(r)
        batch = len(w.running)
        budget = c.max_num_batched_tokens - batch
        cost = c.decode_step_s(batch, w.context) if batch else 0.0
        chunked = 0
        while w.queue and budget > 0:
            if not w.is_prefill and not w.head_done and \
                    len(w.running) + len(w.landed) + len(w.prompts_done) >= c.max_num_seqs:
                break  # colocated: a prompt takes its seat when it starts, as the engine admits it
            r = w.queue[0]
            start = w.head_done
            end = min(r.prompt, start + budget)
            cost += c.prefill_chunk_s(start, end)
            budget -= end - start
            chunked += end - start
            if end == r.prompt:
                w.queue.popleft()
                w.prompts_done.append(r)
                w.head_done = 0
            else:
                w.head_done = end
        if not batch and not chunked:
            return
        if chunked and not batch:
            cost += c.prefill_overhead_s
        w.chunked = chunked
        w.busy = True
        self.push(t + cost, _STEP, w.index, w.is_prefill)

    def end_step(self, w: _Worker, t: float) -> None:
        w.busy = False
        w.queued_tokens -= w.chunked
        w.chunked = 0
        w.steps += 1
        w.step_ends.append(t)
        batch = len(w.running)
        if batch:
            self.itl_steps.append((t - w.step_ends[-2], batch - len(w.joined)))
            for r in w.joined:
                r.first_gap = t - r.first_token
            w.joined.clear()
            w.context += batch
            while w.running and w.running[0][0] == w.steps:
                _, _, r = heapq.heappop(w.running)
                w.context -= r.prompt + r.output
                self.finish(w, r, t)
        for r in w.prompts_done:
            r.first_token = t
            if w.is_prefill:
                d = self.decode[self.decode_load.best()]
                d.num_assigned += 1
                self.decode_load.set(d)
                self.push(t + self.costs.kv_transfer_s(r.prompt), _LAND, d.index, r)
            else:
                w.landed.append((r, r.output - 1))
        w.prompts_done.clear()
        (self.decode_load if self.prefill and not w.is_prefill else self.prefill_load).set(w)
        self.start_step(w, t)

    def finish(self, w: _Worker, r: _Request, t: float) -> None:
        r.finish = t
        self.done.append(r)
        w.num_assigned -= 1


def make_requests(traffic: Traffic, seed: int) -> list[_Request]:
    """The traffic's requests: arrival times and lengths drawn from one seeded generator."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for rid in range(traffic.num_requests):
        out.append(_Request(rid, t, traffic.prompt.draw(rng), traffic.output.draw(rng)))
        t += rng.expovariate(traffic.rate_per_s) if traffic.poisson else 1.0 / traffic.rate_per_s
    return out


def simulate(costs: StepCosts, split: Split, traffic: Traffic, slo: Slo = Slo(), seed: int = 0) -> Prediction:
    """Run `traffic` on `split` with `costs`; the same seed gives the same prediction."""
    requests = make_requests(traffic, seed)
    run = _Run(costs, split)
    run.run(requests)
    done = run.done
    ttft_extra, itl_extra = costs.overheads_s(split.colocated)  # the serving path's, latency only
    ttft = [r.first_token - r.arrival + ttft_extra for r in done]
    tpot = [(r.finish - r.first_token) / (r.output - 1) + itl_extra if r.output > 1 else 0.0 for r in done]
    gaps = [(g + itl_extra, n) for g, n in run.itl_steps] + [(r.first_gap + itl_extra, 1) for r in done if r.output > 1]
    met = sum(1 for a, b in zip(ttft, tpot) if slo.met_by(a, b))
    duration = max(r.finish for r in done) - min(r.arrival for r in done)
    return Prediction(split, len(done), _percentiles(ttft), _weighted_percentiles(gaps), _percentiles(tpot),
                      duration, met / len(done), met / duration if duration > 0 else math.inf)


def _percentiles(values: list[float]) -> dict[int, float]:
    s = sorted(values)
    return {p: 1e3 * s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))] if s else 0.0
            for p in PERCENTILES}


def _weighted_percentiles(samples: list[tuple[float, int]]) -> dict[int, float]:
    s = sorted((v, w) for v, w in samples if w > 0)
    total = sum(w for _, w in s)
    out: dict[int, float] = {}
    for p in PERCENTILES:
        need, acc = p / 100 * total, 0
        value = s[-1][0] if s else 0.0
        for v, w in s:
            acc += w
            if acc >= need:
                value = v
                break
        out[p] = 1e3 * value
    return out
