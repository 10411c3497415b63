"""The cluster simulator against closed forms, its monotonicity, determinism and reach."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pdserve.cluster.cli import main
from pdserve.cluster.sim.simulator import Lengths, Split, Traffic, simulate
from pdserve.cluster.sim.slo import Slo
from pdserve.cluster.sim.step_costs import Curve, StepCosts, least_overheads_s

# Prefill: 10 ms + 0.1 ms a token; decode: 20 ms at batch 1, 50 ms at 64; KV: 1 ms + 1 ms a token.
COSTS = StepCosts(Curve.of([(0, 0.010), (1000, 0.110)]), Curve.of([(1, 0.020), (64, 0.050)]),
                  kv_bytes_per_token=1000, kv_latency_s=0.001, kv_bytes_per_s=1e6)


def _alone(prompt: int, output: int, n: int = 5) -> Traffic:
    """Requests far enough apart that none waits for another."""
    return Traffic(0.5, Lengths(prompt), Lengths(output), num_requests=n, poisson=False)


def test_disaggregated_one_request_at_a_time_is_exact():
    p = simulate(COSTS, Split(1, 1), _alone(200, 10))
    kv_s = 0.001 + 200 * 1000 / 1e6
    assert p.ttft_ms[50] == pytest.approx(10 + 0.1 * 200)  # the prefill curve at 200 tokens
    assert p.itl_ms[50] == pytest.approx(20)  # a batch-1 decode step
    assert p.itl_ms[99] == pytest.approx(1e3 * kv_s + 20)  # the first gap: the transfer, then a step
    assert p.tpot_ms[50] == pytest.approx((1e3 * kv_s + 9 * 20) / 9)
    assert p.num_requests == 5 and p.attainment == 1.0


def test_colocated_one_request_at_a_time_is_exact():
    p = simulate(COSTS, Split(0, 1), _alone(200, 10))
    assert p.ttft_ms[50] == pytest.approx(30)
    assert p.itl_ms[99] == pytest.approx(20) and p.tpot_ms[99] == pytest.approx(20)


def test_the_serving_overheads_add_to_latency_not_to_the_steps():
    """A profile's serving overheads delay every first token and every gap by as much, alone
    and under load: the workers' steps, and so when queues form, stay as measured."""
    costs = dataclasses.replace(COSTS, ttft_overhead_s=0.030, itl_overhead_s=0.005)
    for traffic in (_alone(200, 10), Traffic(40, Lengths(200), Lengths(10), num_requests=200)):
        base, more = simulate(COSTS, Split(1, 1), traffic), simulate(costs, Split(1, 1), traffic)
        for q in (50, 99):
            assert more.ttft_ms[q] == pytest.approx(base.ttft_ms[q] + 30)
            assert more.itl_ms[q] == pytest.approx(base.itl_ms[q] + 5)
            assert more.tpot_ms[q] == pytest.approx(base.tpot_ms[q] + 5)
        assert more.duration_s == pytest.approx(base.duration_s)
    assert StepCosts.from_json(json.loads(json.dumps(costs.to_json()))) == costs


def test_each_setup_takes_its_own_overheads():
    """Disaggregated and colocated splits each add their setup's overheads; a profile that has
    only the one pair (written before the setups had their own) gives colocated splits that
    pair, as before, and one that has both keeps them through its file."""
    costs = COSTS.with_overheads(False, 0.030, 0.005).with_overheads(True, 0.090, 0.002)
    for split, (ttft_ms, itl_ms) in ((Split(1, 1), (30, 5)), (Split(0, 1), (90, 2))):
        base, more = simulate(COSTS, split, _alone(200, 10)), simulate(costs, split, _alone(200, 10))
        assert more.ttft_ms[50] == pytest.approx(base.ttft_ms[50] + ttft_ms)
        assert more.itl_ms[50] == pytest.approx(base.itl_ms[50] + itl_ms)
    assert StepCosts.from_json(json.loads(json.dumps(costs.to_json()))) == costs
    old = {k: v for k, v in costs.to_json().items() if not k.startswith("colocated_")}
    assert StepCosts.from_json(old).overheads_s(colocated=True) == (0.030, 0.005)
    assert costs.engine_only().overheads_s(True) == costs.engine_only().overheads_s(False) == (0.0, 0.0)


def test_the_overheads_are_the_least_calibration_run_over_the_prediction():
    """Each figure's least run: a run slowed by others' load does not inflate the overhead."""
    runs = [(250.0, 95.0), (190.0, 130.0), (400.0, 80.0)]
    assert least_overheads_s(runs, (120.0, 60.0)) == pytest.approx((0.070, 0.020))
    assert least_overheads_s([(100.0, 50.0)], (120.0, 60.0)) == (0.0, 0.0)  # quicker than the profile: none
    with pytest.raises(ValueError):
        least_overheads_s([], (120.0, 60.0))


def test_a_long_prompt_is_chunked_and_costs_its_whole_curve():
    costs = StepCosts(COSTS.prefill, COSTS.decode, max_num_batched_tokens=256)
    p = simulate(costs, Split(1, 1), _alone(1000, 2, n=1))
    assert p.ttft_ms[50] == pytest.approx(110 + 3 * 10)  # four chunks: the curve, and an overhead per extra step


def test_deterministic_arrivals_queue_as_the_closed_form_says():
    # Prompts of 90 ms arriving every 50 ms on one prefill worker: the n-th waits 40 ms more than the one before.
    costs = StepCosts(Curve.of([(0, 0.0), (1000, 0.09)]), COSTS.decode, max_num_batched_tokens=1000)
    traffic = Traffic(20, Lengths(1000), Lengths(1), num_requests=10, poisson=False)
    p = simulate(costs, Split(1, 1), traffic)
    ttfts = sorted(90 + 40 * n for n in range(10))
    assert p.ttft_ms[50] == pytest.approx(ttfts[4])
    assert p.ttft_ms[99] == pytest.approx(ttfts[-1])


@pytest.mark.parametrize("colocated", [False, True])
def test_more_decode_workers_never_worsen_itl_under_load(colocated):
    traffic = Traffic(30, Lengths(200, 0.5), Lengths(80, 0.5), num_requests=1500)
    previous = None
    for d in (1, 2, 3, 4, 6, 8):
        p = simulate(COSTS, Split(0 if colocated else 4, d), traffic)
        if previous is not None:
            for q in (50, 90):
                assert p.itl_ms[q] <= previous.itl_ms[q] + 1e-9, (d, q)
                assert p.tpot_ms[q] <= previous.tpot_ms[q] + 1e-9, (d, q)
        previous = p


def test_more_prefill_workers_never_worsen_ttft_under_load():
    traffic = Traffic(40, Lengths(800, 0.5), Lengths(4), num_requests=800)
    ttfts = [simulate(COSTS, Split(p, 4), traffic).ttft_ms[90] for p in (1, 2, 3, 4, 6)]
    assert ttfts == sorted(ttfts, reverse=True) and ttfts[0] > 2 * ttfts[-1]


def test_same_seed_same_prediction_other_seed_other():
    traffic = Traffic(30, Lengths(200, 0.5), Lengths(50, 0.5), num_requests=300)
    a, b = (simulate(COSTS, Split(2, 2), traffic, seed=1) for _ in range(2))
    assert a == b
    assert simulate(COSTS, Split(2, 2), traffic, seed=2) != a


def test_slo_counts_what_meets_it():
    p = simulate(COSTS, Split(1, 1), _alone(200, 10), Slo(ttft_ms=25, tpot_ms=1000))
    assert p.attainment == 0.0 and p.goodput == 0.0
    p = simulate(COSTS, Split(1, 1), _alone(200, 10), Slo(ttft_ms=35, tpot_ms=1000))
    assert p.attainment == 1.0


def test_ten_thousand_requests_over_a_thousand_workers():
    traffic = Traffic(4000, Lengths(500, 0.5), Lengths(32, 0.5), num_requests=10_000)
    p = simulate(COSTS, Split(300, 700), traffic)
    assert p.num_requests == 10_000 and p.ttft_ms[50] > 0


def test_profile_round_trips_and_the_command_prints_a_table(tmp_path, capsys):
    path = tmp_path / "profile.json"
    COSTS.save(path)
    assert StepCosts.load(path) == COSTS
    assert main(["simulate", "--profile", str(path), "--budget", "3", "--rate", "5", "--requests", "50",
                 "--prompt", "200:0.5", "--output", "20", "--ttft-ms", "100", "--itl-ms", "50"]) == 0
    out = capsys.readouterr().out
    assert "| 1P/2D |" in out and "| 2P/1D |" in out and "| 3 colocated |" in out
    assert main(["simulate", "--profile", str(path), "--rate", "5", "--requests", "20", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["requests"] == 20


def test_a_bad_profile_is_one_line(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"prefill": [[1, 0.1]]}))
    assert main(["simulate", "--profile", str(path), "--rate", "1"]) == 2
    assert "not a step-cost profile" in capsys.readouterr().err
