"""`pdserve spec-sim`: the formula, its explanation, the table and --measured."""

from __future__ import annotations

import argparse
import json

import pytest

from pdserve.cluster.sim import spec_sim_cmd as spec_sim


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    spec_sim.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["spec-sim", *argv])
    return args.func(args)


def test_seed_example(capsys):
    assert run(["--k", "4", "--alpha", "0.75", "--cost-ratio", "0.05", "--trials", "20000"]) == 0
    out = capsys.readouterr().out
    assert "= 3.0508" in out  # (1 - 0.75^5) / 0.25
    assert "= 2.5423" in out  # 3.0508 / (1 + 4 * 0.05)
    assert "3.25" in out and "3.05" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and line[2:4].strip().isdigit()]
    assert len(rows) == 9  # K = 0..8
    assert "<- best" in out


def test_simulation_agrees_with_the_closed_form():
    assert spec_sim.simulate_tokens_per_pass(0.75, 4, 200_000) == pytest.approx(3.0508, abs=0.02)


def test_measured_file(tmp_path, capsys):
    f = tmp_path / "spec.json"
    f.write_text(json.dumps({"runs": [{"drafter": "ngram", "workload": "copy", "k": 4, "alpha": 0.5,
                                       "cost_ratio": 0.0, "tokens_per_pass": 1.9, "speedup": 1.5}]}))
    assert run(["--measured", str(f)]) == 0
    out = capsys.readouterr().out
    assert "| ngram | copy | 4 | 0.500 | 0.000 | 1.00 | 1.938 | 1.900 | 1.938 | 1.938 | 1.500 |" in out


@pytest.mark.parametrize("argv, message", [
    (["--k", "17"], "K must be in"),
    (["--alpha", "1.5"], "alpha must be in"),
    (["--cost-ratio", "-1"], "cost ratio"),
])
def test_bad_arguments(argv, message):
    with pytest.raises(ValueError, match=message):
        run(argv)


def test_bad_measured_file(tmp_path):
    f = tmp_path / "x.json"
    f.write_text("{}")
    with pytest.raises(ValueError, match="not a benchmarks/spec.py result"):
        run(["--measured", str(f)])
