"""`pdserve spec-sim`: what speculative decoding should buy, from α, K and c.

Which number it computes, and why it is not the seed's 3.25: with a per-token
acceptance rate α, the first rejection ends a pass, so the target keeps
x_1..x_n with probability α^n (1 − α) (n < K), all K with probability α^K,
and always adds one token of its own. The expected tokens per target pass is
therefore 1 + α + … + α^K = (1 − α^(K+1)) / (1 − α) (Leviathan et al. 2023,
eq. 1): 3.05 for K=4, α=0.75. The seed's page shows 3.25; its source is not
at hand, but 3.25 is what you get by, for instance, counting 1 + (K − 1)·α
(acceptances treated as independent rather than stopping at the first
rejection), or from a Monte-Carlo run over a few dozen passes (3.05 ± 0.3).
This command computes the closed form, and a seeded Monte-Carlo simulation
of the same process beside it, which agrees with the closed form.

The speedup divides by the cost of a pass in target decode steps: 1 for
verifying K+1 tokens (memory-bound decoding reads the weights once either way)
plus K draft steps of relative cost c: (1 − α^(K+1)) / (1 − α) / (1 + K·c).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from pdserve.engine.config import MAX_SPECULATIVE_TOKENS
from pdserve.engine.speculative.adaptive import best_k, expected_speedup, expected_tokens_per_pass


def simulate_tokens_per_pass(alpha: float, k: int, num_passes: int, seed: int = 0) -> float:
    """Monte-Carlo mean tokens per pass: accept each proposal with probability α
    until the first rejection, then add the target's own token."""
    rng = random.Random(seed)
    total = 0
    for _ in range(num_passes):
        n = 0
        while n < k and rng.random() < alpha:
            n += 1
        total += n + 1
    return total / num_passes


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `spec-sim` on the `pdserve` subcommand parsers."""
    p = subparsers.add_parser("spec-sim", help="expected tokens per pass and speedup of speculative decoding",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--k", type=int, default=4, help="proposed tokens per pass")
    p.add_argument("--alpha", type=float, default=0.75, help="per-token acceptance rate, in [0, 1]")
    p.add_argument("--cost-ratio", type=float, default=0.05, help="c: one draft step's cost / one target decode step's")
    p.add_argument("--max-k", type=int, default=8, help="largest K in the table")
    p.add_argument("--trials", type=int, default=100_000, help="Monte-Carlo passes per row (0: skip)")
    p.add_argument("--measured", type=Path, default=None,
                   help="JSON written by benchmarks/spec.py: take α, c and K from each measured drafter")
    p.set_defaults(func=cmd_spec_sim)
    return p


def cmd_spec_sim(args: argparse.Namespace) -> int:
    if args.measured is not None:
        print_measured(_read_measured(args.measured))
        return 0
    _check(args.k, args.alpha, args.cost_ratio)
    if not 0 <= args.max_k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"--max-k must be in [0, {MAX_SPECULATIVE_TOKENS}], got {args.max_k}")
    print_summary(args.k, args.alpha, args.cost_ratio, args.trials)
    print()
    print_table(args.alpha, args.cost_ratio, max(args.max_k, args.k), args.trials)
    return 0


def print_summary(k: int, alpha: float, c: float, trials: int) -> None:
    tokens = expected_tokens_per_pass(alpha, k)
    print(f"K={k}  alpha={alpha:g}  c={c:g}")
    print(f"expected tokens per target pass   (1 - a^(K+1)) / (1 - a) = {tokens:.4f}")
    if trials:
        print(f"  Monte-Carlo check ({trials} passes)             = "
              f"{simulate_tokens_per_pass(alpha, k, trials):.4f}")
    print(f"cost of a pass in target steps    1 + K*c                 = {1 + k * c:.4f}")
    print(f"expected speedup                  tokens / cost           = {expected_speedup(alpha, k, c):.4f}")
    print()
    print("This is the closed-form expectation (Leviathan et al. 2023): a pass stops at the first\n"
          "rejected proposal and the target always adds one token, so E = 1 + a + ... + a^K.\n"
          "The seed's page shows 3.25 for K=4, a=0.75 where this gives 3.05; 3.25 is not the\n"
          "expectation of that process (it equals e.g. 1 + (K-1)*a, which ignores that a\n"
          "rejection ends the pass). The Monte-Carlo line simulates the process itself and\n"
          "agrees with the closed form.")


def print_table(alpha: float, c: float, max_k: int, trials: int) -> None:
    best = best_k(alpha, max_k, c)
    header = "|  K | tokens/pass | simulated | cost (1+Kc) | speedup |"
    print(header)
    print("|---:|---:|---:|---:|---:|")
    for k in range(max_k + 1):
        sim = f"{simulate_tokens_per_pass(alpha, k, trials, seed=k):.3f}" if trials else "-"
        mark = "  <- best" if k == best else ""
        print(f"| {k:2d} | {expected_tokens_per_pass(alpha, k):.3f} | {sim} | {1 + k * c:.3f} | "
              f"{expected_speedup(alpha, k, c):.3f} |{mark}")


def print_measured(runs: list[dict[str, Any]]) -> None:
    """Prediction from each measured α and c beside what the benchmark measured.

    The formula prices verifying K+1 tokens like one decode step; where the
    benchmark measured that pass as v decode steps (compute-bound CPUs: v > 1),
    the last prediction divides by v + K·c instead.
    """
    print("| drafter | workload | K | alpha | c | v | tokens/pass predicted | measured | speedup (1+Kc) "
          "| (v+Kc) | measured | best K |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in runs:
        k, alpha, c = r["k"], r["alpha"], r["cost_ratio"]
        v = float(r.get("verify_cost", 1.0))
        tokens = expected_tokens_per_pass(alpha, k)
        print(f"| {r['drafter']} | {r['workload']} | {k} | {alpha:.3f} | {c:.3f} | {v:.2f} | {tokens:.3f} | "
              f"{r['tokens_per_pass']:.3f} | {expected_speedup(alpha, k, c):.3f} | {tokens / (v + k * c):.3f} | "
              f"{r['speedup']:.3f} | {best_k(alpha, MAX_SPECULATIVE_TOKENS, c)} |")


def _read_measured(path: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(path.read_text())
        runs = data["runs"]
        for r in runs:
            _check(r["k"], r["alpha"], r["cost_ratio"])
            float(r["tokens_per_pass"]), float(r["speedup"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a benchmarks/spec.py result ({type(e).__name__}: {e})") from e
    return runs


def _check(k: int, alpha: float, c: float) -> None:
    if not 0 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"K must be in [0, {MAX_SPECULATIVE_TOKENS}], got {k}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if c < 0:
        raise ValueError(f"cost ratio must be >= 0, got {c}")
