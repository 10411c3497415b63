"""The planner on made-up load reports with a fake clock (no Ray): it follows a traffic shift and
back, holds on steady traffic, reports unmeetable targets without flapping, dry-run changes
nothing, and its correction factor learns what the simulator misses without flapping on a wild
interval."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from pdserve.cluster.scaling.planner import LENGTH_SPREAD, Action, Correction, Observation, Planner, actions_between
from pdserve.cluster.serving.metrics import Metrics
from pdserve.cluster.settings.pool_config import PlannerConfig
from pdserve.cluster.sim.simulator import Lengths, Prediction, Split, Traffic, simulate
from pdserve.cluster.sim.step_costs import Curve, StepCosts

# Prefill 10k tokens/s; decode 20 ms a step at batch 1, 50 ms at 64.
COSTS = StepCosts(Curve.of([(0, 0.010), (1000, 0.110)]), Curve.of([(1, 0.020), (64, 0.050)]),
                  kv_bytes_per_token=1000, kv_latency_s=0.001, kv_bytes_per_s=1e9)
CONFIG = PlannerConfig(ttft_target_ms=800, itl_target_ms=60, interval_s=30, window_s=60, min_change_interval_s=60,
                       hysteresis=2, sim_requests=200)
CHAT = (20.0, 100, 200)  # requests/s, prompt tokens, output tokens: decode-bound
LONG_PROMPTS = (15.0, 1500, 10)  # prefill-bound
INTERVAL = CONFIG.interval_s


def scaled(costs: StepCosts, k: float) -> StepCosts:
    """`costs` with every step and the KV transfer's latency k times as long."""
    return dataclasses.replace(
        costs, prefill=Curve(costs.prefill.xs, tuple(k * y for y in costs.prefill.ys)),
        decode=Curve(costs.decode.xs, tuple(k * y for y in costs.decode.ys)), kv_latency_s=k * costs.kv_latency_s,
        decode_s_per_context_token=k * costs.decode_s_per_context_token)


def as_planned(traffic: tuple[float, int, int], config: PlannerConfig = CONFIG) -> Traffic:
    """The traffic as the planner estimates it from steady load reports."""
    rate, prompt, output = traffic
    return Traffic(rate, Lengths(prompt, LENGTH_SPREAD), Lengths(output, LENGTH_SPREAD), config.sim_requests)


def meets(pred: Prediction, config: PlannerConfig = CONFIG) -> bool:
    return pred.ttft_ms[90] <= config.ttft_target_ms and pred.tpot_ms[90] <= config.itl_target_ms


class FakeCluster:
    """Applies the planner's actions to a split; reports each interval's traffic as the load
    reports would, and, given `truth` (the step costs the servers really have), the TTFT and
    ITL percentiles the histograms would show: the simulator's with those costs."""

    def __init__(self, planner: Planner, split: Split, truth: StepCosts | None = None) -> None:
        self.planner = planner
        self.split = split
        self.truth = truth
        self.now = 0.0
        self.decisions = []

    def observed(self, traffic: tuple[float, int, int]) -> tuple[float | None, float | None]:
        if self.truth is None:
            return None, None
        pred = simulate(self.truth, self.split, as_planned(traffic, self.planner.config))
        return pred.ttft_ms[90], pred.itl_ms[90]

    def run(self, traffic: tuple[float, int, int], intervals: int) -> list[Split]:
        rate, prompt, output = traffic
        seen = []
        for _ in range(intervals):
            self.now += INTERVAL
            n = round(rate * INTERVAL)
            ttft_ms, itl_ms = self.observed(traffic)
            d = self.planner.observe(Observation(self.now, self.split.num_prefill, self.split.num_decode, n,
                                                 n * prompt, n, n * output, ttft_ms=ttft_ms, itl_ms=itl_ms))
            self.decisions.append(d)
            for a in d.actions:
                self.split = _apply(self.split, a)
            seen.append(self.split)
        return seen


def _apply(split: Split, action: Action) -> Split:
    p, d = split.num_prefill, split.num_decode
    step = {"add": 1, "remove": -1}.get(action.kind, 0)
    if action.kind == "move":
        p, d = (p + 1, d - 1) if action.role == "prefill" else (p - 1, d + 1)
    elif action.role == "prefill":
        p += step
    else:
        d += step
    return Split(p, d)


def _cluster(config: PlannerConfig = CONFIG, split: Split = Split(1, 3), budget: int = 4,
             truth: StepCosts | None = None) -> FakeCluster:
    return FakeCluster(Planner(config, COSTS, budget), split, truth)


def test_long_prompts_move_capacity_to_prefill_and_back():
    cluster = _cluster()
    assert cluster.run(CHAT, 4) == [Split(1, 3)] * 4  # the chat split meets the targets
    to_prefill = cluster.run(LONG_PROMPTS, 6)
    assert to_prefill[-1].num_prefill >= 3, to_prefill
    # Within a bounded number of intervals: the window fills, then the hysteresis.
    assert to_prefill.index(to_prefill[-1]) <= 3, to_prefill
    assert all(s.num_prefill + s.num_decode <= 4 for s in to_prefill)
    changes = [d for d in cluster.decisions if d.actions]
    assert changes and "misses the targets" in changes[-1].reason
    assert {a.kind for a in changes[-1].actions} == {"move"}  # a fixed budget: role changes
    back = cluster.run(CHAT, 6)
    assert back[-1].num_prefill == 1 and back[-1].num_decode >= 2 and back.index(back[-1]) <= 3, back


def test_a_split_that_misses_as_observed_is_not_shrunk():
    """Long prompts on 2P/1D of a budget of 4: the prediction says one prefill worker would do,
    but the server observes TTFTs past the target. Fewer workers would miss by more: the
    planner keeps (or grows) what it has, never removes a worker."""
    # The rule alone, without the correction (which would learn the 3x miss and keep the worker
    # past the one good interval at the end too).
    config = dataclasses.replace(CONFIG, hysteresis=1, min_change_interval_s=0, correction_intervals=0)
    planner = Planner(config, COSTS, 4)
    rate, prompt, output = 2.0, 1500, 10  # 1P/1D predicted within the targets
    assert planner._score(planner._predict(Split(1, 1), Traffic(rate, Lengths(prompt, 0.5), Lengths(output, 0.5),
                                                                CONFIG.sim_requests))) <= 1 - CONFIG.min_gain
    n = round(rate * INTERVAL)
    for i in range(1, 5):
        d = planner.observe(Observation(i * INTERVAL, 2, 1, n, n * prompt, n, n * output,
                                        ttft_ms=3 * CONFIG.ttft_target_ms))
        assert d.target.num_prefill + d.target.num_decode >= 3, d.reason
        assert all(a.kind != "remove" for a in d.actions), d.reason
    # Observed within the targets, the idle worker goes as before.
    d = planner.observe(Observation(5 * INTERVAL, 2, 1, n, n * prompt, n, n * output, ttft_ms=100))
    assert d.target.num_prefill + d.target.num_decode < 3 and "fewer workers" in d.reason


def test_steady_traffic_changes_nothing():
    """Steady traffic, with nothing observed and with the histograms showing what the simulator
    predicts (a correction factor of 1): no change, ever."""
    for traffic, split in ((CHAT, Split(1, 3)), (LONG_PROMPTS, Split(3, 1))):
        for truth in (None, COSTS):
            cluster = _cluster(split=split, truth=truth)
            assert cluster.run(traffic, 10) == [split] * 10
            assert all(d.outcome == "hold" for d in cluster.decisions[2:]), [d.reason for d in cluster.decisions]
            c = cluster.decisions[-1].correction
            assert (c.ttft, c.itl) == pytest.approx((1.0, 1.0))


def test_unmeetable_targets_are_reported_without_flapping():
    config = dataclasses.replace(CONFIG, ttft_target_ms=5, itl_target_ms=5)  # below a single step's cost
    cluster = _cluster(config)
    seen = cluster.run(LONG_PROMPTS, 8) + cluster.run(CHAT, 8)
    assert all(d.unmeetable for d in cluster.decisions[1:])
    changes = [d for d in cluster.decisions if d.actions]
    assert len(changes) <= 2, [(d.current, d.target) for d in changes]  # at most one move per traffic phase
    assert len(set(seen[-4:])) == 1 and len(set(seen[4:8])) == 1


def test_hysteresis_counts_intervals_in_a_row():
    """A change wanted, then an interval that holds, then wanted again: one interval in a row,
    not two (alternating readings must not add up to a change)."""
    cluster = _cluster(dataclasses.replace(CONFIG, window_s=INTERVAL))  # each interval's traffic alone
    seen = cluster.run(LONG_PROMPTS, 1) + cluster.run(CHAT, 1) + cluster.run(LONG_PROMPTS, 1)
    assert seen == [Split(1, 3)] * 3
    assert [d.outcome for d in cluster.decisions] == ["pending", "hold", "pending"], \
        [d.reason for d in cluster.decisions]
    assert cluster.run(LONG_PROMPTS, 1)[-1].num_prefill >= 3  # two in a row: the change


def test_dry_run_decides_and_changes_nothing():
    cluster = _cluster(dataclasses.replace(CONFIG, dry_run=True))
    seen = cluster.run(LONG_PROMPTS, 6)
    assert seen == [Split(1, 3)] * 6
    wanted = [d for d in cluster.decisions if d.outcome == "dry_run"]
    assert wanted and wanted[-1].target.num_prefill >= 3 and not any(d.actions for d in cluster.decisions)


def test_too_little_traffic_holds():
    cluster = _cluster()
    assert cluster.run((0.1, 100, 10), 3) == [Split(1, 3)] * 3
    assert "too little traffic" in cluster.decisions[-1].reason


def test_idle_workers_go_within_the_budget():
    cluster = _cluster(budget=8, split=Split(4, 4))
    seen = cluster.run((2.0, 100, 50), 6)
    assert seen[-1].num_prefill + seen[-1].num_decode < 8
    assert "fewer workers" in next(d.reason for d in cluster.decisions if d.actions)


@pytest.mark.parametrize(("current", "target", "expected"), [
    (Split(1, 3), Split(3, 1), ["move prefill", "move prefill"]),
    (Split(3, 1), Split(1, 2), ["move decode", "remove prefill"]),
    (Split(1, 1), Split(2, 3), ["add prefill", "add decode", "add decode"]),
])
def test_actions_move_roles_first(current, target, expected):
    assert [f"{a.kind} {a.role}" for a in actions_between(current, target)] == expected


def test_config_needs_a_profile_when_on():
    with pytest.raises(ValueError, match="profile"):
        PlannerConfig(enabled=True)


def test_a_large_budget_is_searched_and_finds_the_best_split():
    """Above EXHAUSTIVE_SPLITS a split's size is searched, not walked: the same best as every split."""
    config = dataclasses.replace(CONFIG, sim_requests=300)
    planner = Planner(config, COSTS, 40)
    traffic = Traffic(200.0, Lengths(1000, 0.5), Lengths(40, 0.5), 300)
    obs = Observation(0.0, 20, 20, 0, 0, 0, 0)
    split, pred = planner._best_of(40, traffic, obs)
    walked = min(planner._score(simulate(COSTS, Split(p, 40 - p), traffic, planner.slo)) for p in range(1, 40))
    assert planner._score(pred) == pytest.approx(walked) and 1 < split.num_prefill < 39


# Decode-bound traffic that one decode worker serves within 80 ms ITL by the simulator's costs,
# but not by costs twice as high: two decode workers are needed.
BUSY_CHAT = (8.0, 200, 100)
LOOSE_ITL = dataclasses.replace(CONFIG, itl_target_ms=80)


def test_a_simulator_that_under_predicts_2x_is_corrected(caplog):
    """The servers' steps take twice what the profile says. Uncorrected, the planner keeps a
    split it predicts within the targets and the servers miss them at every interval; corrected,
    it learns the factor from the histograms and moves to a split that meets them (as the true
    costs say), then holds on the steady traffic."""
    truth = scaled(COSTS, 2)
    planned = as_planned(BUSY_CHAT, LOOSE_ITL)
    assert meets(simulate(COSTS, Split(1, 1), planned), LOOSE_ITL)  # as the profile says
    assert not meets(simulate(truth, Split(1, 1), planned), LOOSE_ITL)  # as it is

    uncorrected = _cluster(dataclasses.replace(LOOSE_ITL, correction_intervals=0), Split(1, 1), truth=truth)
    assert uncorrected.run(BUSY_CHAT, 12)[-1] == Split(1, 1)
    assert not meets(simulate(truth, uncorrected.split, planned), LOOSE_ITL)

    corrected = _cluster(LOOSE_ITL, Split(1, 1), truth=truth)
    with caplog.at_level(logging.INFO, logger="pdserve.cluster.scaling.planner"):
        seen = corrected.run(BUSY_CHAT, 12)
    assert any(r.getMessage().startswith("planner: change 1P/1D -> ") and "(correction TTFT x" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert corrected.split != Split(1, 1) and meets(simulate(truth, corrected.split, planned), LOOSE_ITL), seen
    assert corrected.decisions[-1].correction.itl > 2, corrected.decisions[-1].correction
    change = next(d for d in corrected.decisions if d.actions)
    assert "predicted (corrected)" in change.reason and "misses the targets" in change.reason, change.reason
    assert corrected.run(BUSY_CHAT, 10) == [corrected.split] * 10  # steady traffic: no change after


def test_the_correction_is_clamped_and_a_wild_interval_changes_nothing():
    """Histograms far off the prediction (a stall on a shared host, three samples): one such
    interval, high or low, moves the factor not at all, so nothing changes on steady traffic;
    a lasting one moves it to the clamp and never past."""
    config = CONFIG
    planner = Planner(config, COSTS, 4)
    n = round(CHAT[0] * INTERVAL)
    pred = planner._predict(Split(1, 3), as_planned(CHAT))

    def observe(i: int, scale: float):
        return planner.observe(Observation(i * INTERVAL, 1, 3, n, n * CHAT[1], n, n * CHAT[2],
                                           ttft_ms=scale * pred.ttft_ms[90], itl_ms=scale * pred.itl_ms[90]))

    # The truth, one wild high reading, the truth, one wild low one, the truth.
    scales = [1.0] * 3 + [1000.0] + [1.0] * 4 + [0.001] + [1.0] * 4
    decisions = [observe(i, scale) for i, scale in enumerate(scales, start=1)]
    assert all(d.correction == Correction() for d in decisions), [d.correction for d in decisions]
    assert not any(d.actions for d in decisions), [d.reason for d in decisions if d.outcome != "hold"]
    # A stall that lasts: the factor goes to the clamp within half the intervals, not past it.
    lasting = [observe(i, 1000.0).correction for i in range(len(scales) + 1, len(scales) + 1 + 6)]
    assert lasting[config.correction_intervals // 2] == Correction(config.correction_max, config.correction_max)
    assert all(c.ttft <= config.correction_max and c.itl <= config.correction_max for c in lasting)


def test_the_correction_is_learnt_only_while_the_split_holds_still():
    """An interval whose split differs from the one before mixes two splits in its histograms:
    its ratio is not learnt."""
    planner = Planner(CONFIG, COSTS, 4)
    n = round(CHAT[0] * INTERVAL)
    for i, split in enumerate([Split(1, 3), Split(2, 2), Split(1, 3), Split(2, 2)], start=1):
        d = planner.observe(Observation(i * INTERVAL, split.num_prefill, split.num_decode, n, n * CHAT[1], n,
                                        n * CHAT[2], ttft_ms=10 * CONFIG.ttft_target_ms,
                                        itl_ms=10 * CONFIG.itl_target_ms))
        assert d.correction == Correction()
    held = [planner.observe(Observation(i * INTERVAL, 2, 2, n, n * CHAT[1], n, n * CHAT[2],
                                        ttft_ms=10 * CONFIG.ttft_target_ms, itl_ms=10 * CONFIG.itl_target_ms))
            for i in range(5, 8)]
    assert [d.correction for d in held[:2]] == [Correction()] * 2  # a minority of the intervals: the median holds
    assert held[-1].correction.ttft > 1 and held[-1].correction.itl > 1


def test_the_correction_starts_afresh_when_the_traffics_shape_changes():
    """A factor learnt on one mix (here x10 observed on chat) is not carried to another: once
    the window's mean prompt or output length is twice or half what learning began at, the
    factor is 1 again (run 5 of the planner shift: chat's ITL factor delayed the move to
    prefill for long prompts). Steady traffic keeps what it learnt."""
    config = dataclasses.replace(CONFIG, hysteresis=100)  # learning only: no change of split
    planner = Planner(config, COSTS, 4)

    def observe(i: int, traffic: tuple[float, int, int]):
        n = round(traffic[0] * INTERVAL)
        return planner.observe(Observation(i * INTERVAL, 1, 3, n, n * traffic[1], n, n * traffic[2],
                                           ttft_ms=10 * config.ttft_target_ms, itl_ms=10 * config.itl_target_ms))

    learnt = [observe(i, CHAT).correction for i in range(1, 7)]
    assert learnt[-1].ttft > 1 and learnt[-1].itl > 1, learnt
    shifted = [observe(i, LONG_PROMPTS) for i in range(7, 10)]
    assert any(d.correction == Correction() for d in shifted), [d.correction for d in shifted]


def test_the_correction_is_exported_with_the_decision():
    cluster = _cluster(split=Split(1, 1), truth=scaled(COSTS, 2), config=LOOSE_ITL)
    cluster.run(BUSY_CHAT, 5)
    metrics = Metrics()
    decision = cluster.decisions[-1]
    metrics.planner_decision(decision, CONFIG.percentile)
    assert decision.correction.itl > 1
    assert metrics.planner_correction.labels("itl")._value.get() == pytest.approx(decision.correction.itl)
    assert metrics.planner_correction.labels("ttft")._value.get() == pytest.approx(decision.correction.ttft)


@pytest.mark.parametrize("bad", [{"correction_intervals": -1}, {"correction_min": 1.2}, {"correction_max": 0.9},
                                 {"correction_min": 0}, {"drain_deadline_s": -1}])
def test_config_refuses_a_bad_correction_or_drain_bound(bad):
    with pytest.raises(ValueError):
        PlannerConfig(**bad)
