"""The planner: the split of a GPU budget between prefill and decode workers that meets the
TTFT and ITL targets for the traffic of the last minutes, chosen with the cluster simulator.

Why a simulator and not a rule ("prefill queue long: add a prefill worker"): a rule sees one
pool at a time, while a move changes both (a role change takes a decode worker to give a
prefill one), and the step costs are not linear (a decode step costs little more at batch 64
than at 8 on a GPU). Dynamo's SLA planner and DistServe size pools from measured costs the
same way.

Each `observe` (one per interval) estimates the traffic from the window's load reports
(arrival rate, mean prompt and output lengths), predicts the latencies of every split of the
smallest budget that meets the targets (all of it when none does), and compares the best with
the present split. It moves only when that is worth it and lasting:
- the present split misses a target (predicted, or observed: the TTFT and ITL histograms,
  or a prefill backlog that alone takes longer than the TTFT target) and the best of at
  least as many workers meets both (a split that misses is never shrunk);
- or fewer workers meet both with `min_gain` to spare (idle GPUs go back);
- or no split meets them (reported as unmeetable at every interval, not chased) and the best
  is predicted better by `min_gain`;
and the same split was wanted `hysteresis` intervals in a row, `min_change_interval_s` after
the last change. Every decision carries its reason; dry-run decides and changes nothing.

The simulator knows the engine's steps and the profile's serving overheads, not everything a
served request waits (a shared host, prefix hits, bursts). So, as Dynamo's SLA planner does,
each prediction is multiplied by a correction factor per latency (`Correction`): observed over
predicted for the present split, clamped, the median of the last intervals' (`Corrector`),
learnt only while the split holds still (a change in flight mixes two splits in one interval's
histograms). The log line of each decision and /metrics carry the factors.
The planner is pure (a clock comes with each observation); `planner_loop.py` feeds it and
carries out its actions through `Elastic`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import statistics
from dataclasses import dataclass

from pdserve.cluster.settings.pool_config import PlannerConfig
from pdserve.cluster.sim.simulator import Lengths, Prediction, Split, Traffic, simulate
from pdserve.cluster.sim.slo import Slo
from pdserve.cluster.sim.step_costs import StepCosts

logger = logging.getLogger(__name__)

# Splits of one size tried one by one up to this many; above, a ternary search (`_best_of`).
EXHAUSTIVE_SPLITS = 16

# The load reports carry sums, not distributions: lengths are taken as uniform within ±50% of
# the window's means, the spread of typical chat traffic.
LENGTH_SPREAD = 0.5


@dataclass(frozen=True, slots=True)
class Observation:
    """One interval's look at the server, from the workers' load reports and /metrics' counters."""

    now: float  # seconds, any monotonic clock
    num_prefill: int  # serving workers of each role
    num_decode: int
    num_arrived: int  # requests that arrived since the last observation
    num_prompt_tokens: int  # their prompt tokens
    num_finished: int  # requests that finished since the last observation
    num_output_tokens: int  # the tokens they generated
    queued_prefill_tokens: int = 0  # prompt tokens waiting on the prefill workers now
    kv_usage: float = 0.0  # the decode workers' mean share of KV blocks in use
    ttft_ms: float | None = None  # observed over the interval at the planner's percentile (None: no samples)
    itl_ms: float | None = None


@dataclass(frozen=True, slots=True)
class Correction:
    """What the planner multiplies the simulator's predictions by: observed over predicted, per
    latency (1: the simulator is taken at its word)."""

    ttft: float = 1.0
    itl: float = 1.0

    def __str__(self) -> str:
        return f"correction TTFT x{self.ttft:.2f}, ITL x{self.itl:.2f}"


class Corrector:
    """Learns the `Correction`: per latency, the last `correction_intervals` ratios of observed
    over predicted, each clamped to [`correction_min`, `correction_max`]; the factor is their
    median, and starts from as many 1s. A median, not a mean: one wild interval (a stall on a
    shared host, a histogram of three samples), or any minority of the intervals, moves it not
    at all, so it cannot flap the pools; a lasting error takes over once it fills half of them.

    What it learns holds for the traffic it was learnt on: on a shared host a decode-heavy mix
    misses its ITL by what the prefills beside it take, which says nothing of a prefill-heavy
    one. So a change of the traffic's shape (its mean prompt or output length `SHAPE_CHANGE`
    times or more away from where learning began) starts it afresh: in the planner shift of
    stop 49 (RESULTS, run 5) the ITL factor learnt in the chat phase (x3) held for the long
    prompts and delayed the move to prefill from 21.5 s (run 4, no correction) to 56.6 s."""

    SHAPE_CHANGE = 2.0

    def __init__(self, config: PlannerConfig) -> None:
        self.config = config
        self._shape: tuple[float, float] | None = None  # (mean prompt, mean output) learning began at
        self._reset()

    def _reset(self) -> None:
        n = self.config.correction_intervals
        self._ratios = (collections.deque([1.0] * n, maxlen=n), collections.deque([1.0] * n, maxlen=n))

    def learn(self, ttft_ratio: float | None, itl_ratio: float | None, shape: tuple[float, float]) -> None:
        """One interval's ratios (None: no samples, nothing learnt of that latency), for
        traffic of `shape` (mean prompt and output tokens)."""
        if self._shape is None or any(max(a, b) >= self.SHAPE_CHANGE * min(a, b) for a, b in zip(shape, self._shape)):
            self._shape = shape
            self._reset()
        for ratios, ratio in zip(self._ratios, (ttft_ratio, itl_ratio)):
            if ratio is not None and ratio > 0 and math.isfinite(ratio) and ratios.maxlen:
                ratios.append(min(max(ratio, self.config.correction_min), self.config.correction_max))

    def factors(self) -> Correction:
        ttft, itl = (statistics.median(r) if r else 1.0 for r in self._ratios)
        return Correction(ttft, itl)


@dataclass(frozen=True, slots=True)
class Action:
    """One change through `Elastic`: add or remove a worker of `role`, or move one to `role`."""

    kind: str  # "add", "remove" or "move"
    role: str


@dataclass(frozen=True, slots=True)
class Decision:
    at: float
    current: Split
    target: Split  # the split it wants (current: none better)
    actions: tuple[Action, ...]  # what it does now (empty: nothing, or dry-run)
    reason: str
    unmeetable: bool  # no split of the budget meets the targets for this traffic
    predicted: Prediction | None  # the target split's prediction (the simulator's, before the correction)
    dry_run: bool = False
    correction: Correction = Correction()  # what the predictions were multiplied by

    @property
    def outcome(self) -> str:
        """hold (nothing to change), pending (a change waiting out its hysteresis or interval),
        change, or dry_run (a change it would make)."""
        if self.target == self.current:
            return "hold"
        if self.dry_run:
            return "dry_run"
        return "change" if self.actions else "pending"


def actions_between(current: Split, target: Split) -> tuple[Action, ...]:
    """Role changes first (a fixed budget moves workers rather than stopping and starting
    them), then what is added or removed."""
    dp, dd = target.num_prefill - current.num_prefill, target.num_decode - current.num_decode
    to_prefill, to_decode = min(max(dp, 0), max(-dd, 0)), min(max(dd, 0), max(-dp, 0))
    dp, dd = dp - to_prefill + to_decode, dd - to_decode + to_prefill
    return (*[Action("move", "prefill")] * to_prefill, *[Action("move", "decode")] * to_decode,
            *[Action("add" if dp > 0 else "remove", "prefill")] * abs(dp),
            *[Action("add" if dd > 0 else "remove", "decode")] * abs(dd))


class Planner:
    def __init__(self, config: PlannerConfig, costs: StepCosts, budget: int) -> None:
        """`budget`: the most workers of both roles (`config.max_workers`, else the pools' start)."""
        if budget < config.min_prefill + config.min_decode:
            raise ValueError(f"the planner's budget of {budget} workers is below min_prefill + min_decode")
        self.config = config
        self.costs = costs
        self.budget = budget
        self.slo = Slo(ttft_ms=config.ttft_target_ms, tpot_ms=config.itl_target_ms)
        self._window: collections.deque[tuple[float, Observation]] = collections.deque()  # (start, observation)
        self._last_now: float | None = None
        self._last_change = float("-inf")
        self._pending: Split | None = None
        self._num_pending = 0
        self._unmeetable = False
        # Predictions for the traffic estimated last: steady traffic estimates the same again.
        self._traffic_predicted: Traffic | None = None
        self._predictions: dict[Split, Prediction] = {}
        self._corrector = Corrector(config)
        self._correction = Correction()
        self._last_split: Split | None = None  # the split of the observation before

    def observe(self, obs: Observation) -> Decision:
        """Take one interval's observation; decide (and log why)."""
        decision = dataclasses.replace(self._decide(obs), correction=self._correction)
        if decision.actions:
            self._last_change = obs.now
        if decision.actions or decision.outcome == "hold":  # hysteresis counts intervals in a row
            self._pending, self._num_pending = None, 0
        if decision.unmeetable != self._unmeetable:
            self._unmeetable = decision.unmeetable
            (logger.warning if decision.unmeetable else logger.info)(
                "planner: the targets (TTFT %.0f ms, ITL %.0f ms) are %s", self.slo.ttft_ms, self.slo.tpot_ms,
                "unmeetable by any split of the budget" if decision.unmeetable else "meetable again")
        (logger.info if decision.outcome != "hold" else logger.debug)(
            "planner: %s %s -> %s (%s): %s", decision.outcome, decision.current, decision.target,
            decision.correction, decision.reason)
        return decision

    def _decide(self, obs: Observation) -> Decision:
        current = Split(obs.num_prefill, obs.num_decode)
        held_still, self._last_split = current == self._last_split, current
        traffic = self._traffic(obs)
        if traffic is None:
            return Decision(obs.now, current, current, (), "too little traffic in the window to plan from",
                            False, None, self.config.dry_run)
        now_pred = self._predict(current, traffic)
        if held_still:
            self._correct(obs, now_pred, traffic)
        missed = self._observed_miss(obs)
        # A split that misses the targets is never shrunk: where it misses as observed while
        # its prediction meets them, the prediction is the optimistic one (the serving path,
        # a shared host), and fewer workers would miss by more.
        at_least = current.num_prefill + current.num_decode if missed or self._score(now_pred) > 1 else 0
        target, predicted, unmeetable = self._best(traffic, obs, at_least)
        now_score, score = self._score(now_pred), self._score(predicted)
        predicted_as = "predicted" if self._correction == Correction() else "predicted (corrected)"
        about = (f"{traffic.rate_per_s:.2f} req/s, prompts ~{traffic.prompt.mean}, outputs ~{traffic.output.mean} "
                 f"tokens; {current} {predicted_as} {self._describe(now_pred)}{missed}")
        if target != current:
            about += f"; {target} {self._describe(predicted)}"
        if target == current:
            return Decision(obs.now, current, current, (), f"{current} is the best split: {about}", unmeetable,
                            predicted, self.config.dry_run)
        why = self._why_move(current, target, now_score if not missed else max(now_score, 1.01), score)
        if why is None:
            return Decision(obs.now, current, current, (), f"not worth a change: {about}", unmeetable, now_pred,
                            self.config.dry_run)
        self._num_pending = self._num_pending + 1 if target == self._pending else 1
        self._pending = target
        reason = f"{why}: {about}"
        if self.config.dry_run:
            return Decision(obs.now, current, target, (), reason, unmeetable, predicted, True)
        if self._num_pending < self.config.hysteresis:
            reason += f" (wanted {self._num_pending} of {self.config.hysteresis} intervals)"
            return Decision(obs.now, current, target, (), reason, unmeetable, predicted)
        if obs.now - self._last_change < self.config.min_change_interval_s:
            reason += f" (last change {obs.now - self._last_change:.0f} s ago)"
            return Decision(obs.now, current, target, (), reason, unmeetable, predicted)
        return Decision(obs.now, current, target, actions_between(current, target), reason, unmeetable, predicted)

    def _why_move(self, current: Split, target: Split, now_score: float, score: float) -> str | None:
        gain = self.config.min_gain
        if now_score > 1 >= score:
            return "the present split misses the targets, this one meets them"
        if now_score <= 1 and score <= 1 - gain and \
                target.num_prefill + target.num_decode < current.num_prefill + current.num_decode:
            return "fewer workers meet the targets"
        if now_score > 1 and score > 1 and score < now_score * (1 - gain):
            return "no split meets the targets; this one comes closest"
        return None

    def _traffic(self, obs: Observation) -> Traffic | None:
        start = self._last_now if self._last_now is not None else obs.now - self.config.interval_s
        self._last_now = obs.now
        self._window.append((start, obs))
        while self._window and self._window[0][1].now <= obs.now - self.config.window_s:
            self._window.popleft()
        if not self._window:
            return None
        arrived = sum(o.num_arrived for _, o in self._window)
        finished = sum(o.num_finished for _, o in self._window)
        span = obs.now - self._window[0][0]
        if arrived < self.config.min_requests or not finished or span <= 0:
            return None
        prompt = max(1, round(sum(o.num_prompt_tokens for _, o in self._window) / arrived))
        output = max(1, round(sum(o.num_output_tokens for _, o in self._window) / finished))
        return Traffic(arrived / span, Lengths(prompt, LENGTH_SPREAD), Lengths(output, LENGTH_SPREAD),
                       self.config.sim_requests)

    def _best(self, traffic: Traffic, obs: Observation, at_least: int = 0) -> tuple[Split, Prediction, bool]:
        """The best split of the fewest workers (`at_least` of them) that meet the targets with
        `min_gain` to spare (a binary search: more workers never predict worse), else of the
        whole budget; and whether even that misses them."""
        lo, hi = max(self.config.min_prefill + self.config.min_decode, min(at_least, self.budget)), self.budget
        best = self._best_of(hi, traffic, obs)
        score = self._score(best[1])
        if score > 1 - self.config.min_gain:
            return (*best, score > 1)
        while lo < hi:
            mid = (lo + hi) // 2
            found = self._best_of(mid, traffic, obs)
            if self._score(found[1]) <= 1 - self.config.min_gain:
                best, hi = found, mid
            else:
                lo = mid + 1
        return (*best, False)

    def _best_of(self, total: int, traffic: Traffic, obs: Observation) -> tuple[Split, Prediction]:
        """The best split of `total` workers whose decode pool would not run short of KV: every
        one when there are few, else a ternary search (TTFT falls and ITL rises with the prefill
        share, so the worse of the two against its target is unimodal over it)."""
        lo, hi = self.config.min_prefill, total - self.config.min_decode
        if obs.num_decode and obs.kv_usage:  # the fewest decode workers that keep KV use under the limit
            hi = min(hi, total - math.ceil(obs.kv_usage * obs.num_decode / self.config.kv_usage_limit - 1e-9))
        if hi < lo:  # every split is short of KV: the most decode workers
            split = Split(lo, total - lo)
            return split, self._predict(split, traffic)

        def key(p: int) -> tuple[float, float, int]:
            pred = self._predict(Split(p, total - p), traffic)
            return self._score(pred), -pred.goodput, p

        while hi - lo > EXHAUSTIVE_SPLITS:
            a, b = lo + (hi - lo) // 3, hi - (hi - lo) // 3
            lo, hi = (lo, b) if key(a) <= key(b) else (a, hi)
        p = min(range(lo, hi + 1), key=key)
        split = Split(p, total - p)
        return split, self._predict(split, traffic)

    def _predict(self, split: Split, traffic: Traffic) -> Prediction:
        if traffic != self._traffic_predicted:
            self._traffic_predicted, self._predictions = traffic, {}
        if split not in self._predictions:
            self._predictions[split] = simulate(self.costs, split, traffic, self.slo)
        return self._predictions[split]

    def _correct(self, obs: Observation, now_pred: Prediction, traffic: Traffic) -> None:
        """Learn from the interval what the simulator misses: the observed percentiles (TTFT,
        and ITL over every gap as the histogram has it) against the present split's prediction
        of the same, for this traffic's shape."""
        q = self.config.percentile
        self._corrector.learn(_ratio(obs.ttft_ms, _at(now_pred.ttft_ms, q)),
                              _ratio(obs.itl_ms, _at(now_pred.itl_ms, q)),
                              (traffic.prompt.mean, traffic.output.mean))
        self._correction = self._corrector.factors()

    def _score(self, pred: Prediction) -> float:
        """The worse of the two corrected latencies against its target (<= 1: both met)."""
        q = self.config.percentile
        ttft = self._correction.ttft * _at(pred.ttft_ms, q) / self.slo.ttft_ms
        itl = self._correction.itl * _at(pred.tpot_ms, q) / self.slo.tpot_ms
        return max(ttft, itl)

    def _observed_miss(self, obs: Observation) -> str:
        """Why the server, as observed, misses a target now whatever the prediction ("" if it does not)."""
        c = self.config
        if obs.ttft_ms is not None and obs.ttft_ms > c.ttft_target_ms:
            return f", observed TTFT {obs.ttft_ms:.0f} ms"
        if obs.itl_ms is not None and obs.itl_ms > c.itl_target_ms:
            return f", observed ITL {obs.itl_ms:.0f} ms"
        if obs.num_prefill and obs.queued_prefill_tokens:
            drain_ms = 1e3 * self.costs.prefill(obs.queued_prefill_tokens / obs.num_prefill)
            if drain_ms > c.ttft_target_ms:
                return f", prefill backlog of {obs.queued_prefill_tokens} tokens ({drain_ms:.0f} ms)"
        return ""

    def _describe(self, pred: Prediction) -> str:
        """The prediction as the planner weighs it (corrected)."""
        q, c = self.config.percentile, self._correction
        return f"TTFT p{q} {c.ttft * _at(pred.ttft_ms, q):.0f} ms, ITL p{q} {c.itl * _at(pred.tpot_ms, q):.1f} ms"


def _at(percentiles: dict[int, float], q: int) -> float:
    """The prediction's percentile q, or the next one above it that it has."""
    return percentiles.get(q, percentiles[min((p for p in percentiles if p >= q), default=max(percentiles))])


def _ratio(observed_ms: float | None, predicted_ms: float) -> float | None:
    """Observed over predicted, None where either says nothing (no samples, no gaps predicted)."""
    return observed_ms / predicted_ms if observed_ms is not None and predicted_ms > 0 else None
