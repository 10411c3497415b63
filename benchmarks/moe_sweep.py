"""Fused MoE on one GPU: the plan `plan_for` picks, the best of a tile sweep, main's launch,
a torch reference and the limit, per shape and token count.

    python -m benchmarks.moe_sweep [--shapes qwen3-30b-a3b ...] [--tokens 1 2 4 ...] [--json PATH]

Per (shape, tokens): routing from random logits (the Triton top-k), bf16 experts cycled over
two copies with different routings, so every call reads its experts cold (as a model's layers
do); a plan's calls captured in one CUDA graph, the median of 5 replays. The sweep searches
one kernel's tile at a time: the per-pair path (up to 256 pairs) and the grouped path (from 4
tokens), gate/up with a default down, then down with the best gate/up. "main" is the launch
main had before the per-pair path (grouped, BLOCK_M 16, BLOCK_N 64, BLOCK_K 32). The torch
reference is moe.experts_reference (eager: its loop reads the routing back). Limit: the larger
of the bytes the call must read (each expert it touches once) at 4.3 TB/s and its FLOPs at
700 TFLOP/s. Prints the table, then the `_TUNED` entries for kernels/moe_plan.py.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path

import torch
import triton

from benchmarks.gemv_sweep import graph_us
from pdserve.engine.models.moe import experts_reference
from pdserve.kernels.fused_moe import fused_moe
from pdserve.kernels.moe_plan import Plan, Tile, plan_for
from pdserve.kernels.moe_routing import topk_route

COPY_BW = 4.3e12
PEAK_FLOPS = 700e12
# name -> (experts, hidden, expert intermediate, top_k)
SHAPES = {
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "mixtral-8x7b": (8, 4096, 14336, 2),
    "qwen3-235b-a22b": (128, 4096, 1536, 8),
    "deepseek-v2-lite": (64, 2048, 1408, 6),
}
TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 2048]
MAIN = Plan(True, Tile(64, 32), Tile(64, 32))
PAIR_TILES = [Tile(n, k, w) for n, k, w in itertools.product((2, 4, 8, 16), (128, 256, 512), (4, 8))]
GROUPED_TILES = [Tile(n, k, w, m, s) for m, n, k, w, s in itertools.product((16, 32, 64), (64, 128), (64, 128),
                                                                               (4, 8), (3, 4))]
GROUPED_TILES += [Tile(128, 64, 8, 128, 3), Tile(128, 64, 8, 128, 4), Tile(256, 64, 8, 128, 3),
                  Tile(256, 64, 8, 64, 3), Tile(128, 64, 4, 128, 3)]  # prefill's large tiles


class Case:
    """One shape at one token count: inputs for two cold copies of the experts."""

    def __init__(self, shape: tuple[int, int, int, int], tokens: int) -> None:
        experts, hidden, inter, top_k = shape
        self.shape, self.tokens = shape, tokens
        self.copies = []
        for _ in range(2):
            x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
            w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) / hidden ** 0.5
            w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16) / inter ** 0.5
            weights, ids = topk_route(torch.randn(tokens, experts, device="cuda"), top_k, True)
            self.copies.append((x, w13, w2, weights, ids))
        touched = [int(torch.unique(ids).numel()) for *_, ids in self.copies]
        self.bytes = statistics.mean(touched) * 3 * hidden * inter * 2 + 2 * tokens * hidden * 2
        self.flops = tokens * top_k * 3 * hidden * inter * 2

    def limit_us(self) -> float:
        return max(self.bytes / COPY_BW, self.flops / PEAK_FLOPS) * 1e6

    def time_us(self, plan: Plan) -> float:
        return graph_us(lambda: [fused_moe(*c, plan=plan) for c in self.copies], replays=5) / len(self.copies)

    def kernel_us(self, plan: Plan) -> dict[str, float]:
        """Each kernel's GPU time per call of the plan (torch.profiler over graph replays)."""
        from torch.profiler import ProfilerActivity, profile

        graph_us(lambda: [fused_moe(*c, plan=plan) for c in self.copies])  # compiled, warm
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                for c in self.copies:
                    fused_moe(*c, plan=plan)
            torch.cuda.synchronize()
        calls = 5 * len(self.copies)
        return {e.key[:40]: e.device_time_total / calls for e in prof.key_averages()
                if e.device_type.name == "CUDA" and e.device_time_total > 0}

    def reference_us(self) -> float:
        for c in self.copies:
            experts_reference(*c)
        times = []
        for _ in range(3):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for c in self.copies:
                experts_reference(*c)
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) * 1e3 / len(self.copies))
        return statistics.median(times)

    def check(self, plan: Plan) -> float:
        """Relative error of the plan's output against the float32 torch reference."""
        x, w13, w2, weights, ids = self.copies[0]
        ref = experts_reference(x.float(), w13.float(), w2.float(), weights, ids)
        out = fused_moe(x, w13, w2, weights, ids, plan=plan).float()
        return float((out - ref).norm() / ref.norm())


def search(case: Case, grouped: bool) -> tuple[Plan, float]:
    """The best plan of one path: gate/up's tile with down at the path's first tile, then down's."""
    tiles = GROUPED_TILES if grouped else PAIR_TILES

    def timed(plan: Plan) -> float:
        try:
            return case.time_us(plan)
        except (triton.runtime.errors.OutOfResources, RuntimeError, ValueError):
            return float("inf")

    default = tiles[0] if not grouped else Tile(64, 64)
    best_up = min(tiles, key=lambda t: timed(Plan(grouped, t, default)))
    best_down = min(tiles, key=lambda t: timed(Plan(grouped, best_up, t)))
    plan = Plan(grouped, best_up, best_down)
    return plan, timed(plan)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=TOKENS)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--kernels", action="store_true", help="each kernel's time for the picked plan")
    parser.add_argument("--no-search", action="store_true", help="time the picked plan only")
    args = parser.parse_args()
    rows, tuned = [], {}
    for name in args.shapes:
        shape = SHAPES[name]
        experts, hidden, inter, top_k = shape
        table = []
        for tokens in args.tokens:
            case = Case(shape, tokens)
            picked = plan_for(tokens, *shape)
            row = {"shape": name, "tokens": tokens, "limit_us": case.limit_us(),
                   "picked_us": case.time_us(picked), "main_us": case.time_us(MAIN),
                   "torch_us": case.reference_us(), "picked_error": case.check(picked)}
            if args.kernels:
                row["kernels_us"] = case.kernel_us(picked)
            candidates = [(picked, row["picked_us"])]
            if tokens * top_k <= 256 and not args.no_search:
                candidates.append(search(case, grouped=False))
            if tokens >= 4 and not args.no_search:
                candidates.append(search(case, grouped=True))
            best, best_us = min(candidates, key=lambda c: c[1])
            row.update(best_us=best_us, best=repr(best), best_error=case.check(best))
            table.append((tokens, best))
            rows.append(row)
            print(json.dumps(row), flush=True)
            del case
            torch.cuda.empty_cache()
        tuned[shape] = table
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print("\n| shape | tokens | limit us | picked us | % of limit | best us | main us | torch us | error |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['shape']} | {r['tokens']} | {r['limit_us']:.1f} | {r['picked_us']:.1f} | "
              f"{100 * r['limit_us'] / r['picked_us']:.0f}% | {r['best_us']:.1f} | {r['main_us']:.1f} | "
              f"{r['torch_us']:.0f} | {r['picked_error']:.1e} |")
    print("\n_TUNED = {")
    for shape, table in tuned.items():
        print(f"    {shape}: (")
        for tokens, plan in table:
            print(f"        ({tokens}, {plan!r}),")
        print("    ),")
    print("}")


if __name__ == "__main__":
    main()
