"""Every Triton kernel whose tiles depend on the dtype, compiled for Hopper (sm_90) at the tiles
its launcher picks on a CUDA device, in each dtype it takes: each program's shared memory,
as Triton's compiler counts it, within the 232,448 bytes an H100 or H200 gives one (issue 53:
the fused MoE kernel's float32 tiles asked 417,792 on the first prompt). No GPU needed: the
kernels are compiled, not run (tests/kernels/compiled.py; the cases: compiled_cases.py)."""

from __future__ import annotations

import pytest

from pdserve.kernels import moe_plan
from tests.kernels.compiled import HOPPER_SHARED, shared_memory_of
from tests.kernels.compiled_cases import UNFITTED


def _over(rows: list[dict]) -> list[str]:
    return [f"{r['case']}: {r['kernel']} {r['shared']:,} bytes" for r in rows if r["shared"] > HOPPER_SHARED]


def test_fused_moe_plans_fit_hopper_as_the_compiler_counts_and_as_the_launcher_predicts():
    """The plans `fused_moe` picks and fits, float32 and bf16 x and FP8 experts, every swept
    table's and the rules' at two other shapes: within the card, and the launcher's own count (`fit_plan`
    shrinks tiles by it before any launch) never below the compiler's. The 256-token plan in
    float32 unfitted asks exactly the 417,792 bytes the H100 refused."""
    rows = shared_memory_of("fused_moe")
    unfitted = {r["kernel"]: r["shared"] for r in rows if r["case"] == UNFITTED}
    assert unfitted["_gate_up_silu_kernel"] == 417_792 > HOPPER_SHARED
    fitted = [r for r in rows if r["case"] != UNFITTED]
    plans = sum(len(table) for table in moe_plan._TUNED.values()) + 2 * 2  # the tables' rows, the rules' two
    assert len({r["case"] for r in fitted}) == plans * 4, sorted({r["case"] for r in fitted})
    assert not _over(fitted)
    experts = [r for r in rows if r["kernel"] in r["estimate"]]
    assert {r["kernel"] for r in experts} == set(rows[0]["estimate"])  # both paths' kernels compiled
    low = [f"{r['case']}: {r['kernel']} {r['shared']:,} > {r['estimate'][r['kernel']]:,}" for r in experts
           if r["shared"] > r["estimate"][r["kernel"]]]
    assert not low, low


@pytest.mark.parametrize("family, kernels", [
    ("attention", {"_prefill_kernel", "_decode_split_kernel", "_verify_split_kernel", "_mla_split_kernel",
                   "_mla_prefill_kernel"}),
    ("gemm", {"_gemv_kernel", "_fp8_gemm_kernel"}),
    ("routing", {"_topk_route_kernel", "_grouped_route_kernel"}),
])
def test_attention_and_gemm_tiles_fit_hopper_at_every_dtype_and_head_dim(family, kernels):
    rows = shared_memory_of(family)
    assert kernels <= {r["kernel"] for r in rows}, {r["kernel"] for r in rows}
    assert not _over(rows), _over(rows)


def test_fp8_decode_holds_one_kv_tile_below_five_stages_and_two_from_five():
    """Why the FP8 decode kernel read at 83% of an H100's copy (benchmarks/RESULTS.md, "FP8 KV
    decode: one tile in flight"): its K/V addresses come from a block-table load in the same
    iteration, so Triton's pipeliner spends a stage on that load, and at three stages (main's
    default) keeps a single K/V buffer: the next tile's copies start after this tile's dots
    and are waited for at the top of the next iteration. From five stages it keeps two (three
    at eight)."""
    rows = shared_memory_of("fp8_decode_pipelines")
    assert len(rows) == 5, rows
    for r in rows:
        tiles = r["shared"] // r["estimate"]["tile"]
        assert (tiles >= 2) if r["estimate"]["stages"] >= 5 else (tiles == 1), r
