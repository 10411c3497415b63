"""fused_moe against the float64 reference, on both its paths (per pair and grouped): 1 to
512 tokens, 4 to 64 experts, top-k 1 to 8, experts that receive no token, every token on one
expert, another rank's experts (expert parallelism), and the engine's CPU path
(moe.experts_reference) on the same inputs; topk_route against torch's softmax and topk."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.models.moe import experts_reference, route
from pdserve.kernels import moe_plan as module
from pdserve.kernels.fused_moe import fused_moe
from pdserve.kernels.moe_plan import Plan, Tile, fit_plan, plan_for, shared_memory_bytes, shared_memory_limit
from pdserve.kernels.moe_routing import align_by_expert, topk_route
from tests.kernels.reference import ref_fused_moe, rel_error, tolerance

COVERS = ("fused_moe", "plan_for", "fit_plan", "shared_memory_bytes", "shared_memory_limit", "topk_route",
          "align_by_expert")
HOPPER_SHARED = 232_448  # bytes a program may use on an H100 or H200 (Triton's limit there)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int, dtype: torch.dtype,
            seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE, dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(DEVICE, dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5).to(DEVICE, dtype)
    logits = torch.randn(num_tokens, num_experts, generator=gen).to(DEVICE)
    weights, ids = route(logits, top_k, renormalize=True)
    return x, w13, w2, weights, ids


# Tiles smaller than the test sizes, so every kernel crosses tile edges.
PER_PAIR = Plan(False, Tile(8, 16), Tile(16, 16))
GROUPED = Plan(True, Tile(32, 32), Tile(32, 32))
PLANS = {"per_pair": PER_PAIR, "grouped": GROUPED}

# (tokens, hidden, intermediate, experts, top_k): sizes across the tiles, and the edges.
CASES = [
    (1, 32, 32, 4, 1),
    (1, 64, 16, 64, 8),     # one token, most experts idle
    (5, 64, 48, 8, 2),      # intermediate past one column tile of 32
    (33, 48, 32, 16, 4),    # hidden not a multiple of the K tile
    (48, 16, 16, 8, 8),     # every expert of every token
    (512, 16, 16, 4, 1),
]


@pytest.mark.parametrize("path", PLANS)
@pytest.mark.parametrize(("num_tokens", "hidden", "inter", "num_experts", "top_k"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_moe_matches_the_reference(num_tokens, hidden, inter, num_experts, top_k, dtype, path):
    if path == "per_pair" and num_tokens * top_k > 64:
        num_tokens = 32 // top_k  # the per-pair path's domain (and the interpreter's patience)
    x, w13, w2, weights, ids = _inputs(num_tokens, hidden, inter, num_experts, top_k, dtype)
    out = fused_moe(x, w13, w2, weights, ids, plan=PLANS[path])
    assert out.shape == (num_tokens, hidden) and out.dtype == dtype
    assert rel_error(out, ref_fused_moe(x, w13, w2, weights, ids)) < tolerance(dtype)


@pytest.mark.parametrize("path", PLANS)
def test_every_token_on_one_expert_and_experts_with_none(path):
    x, w13, w2, weights, _ = _inputs(20, 32, 16, 8, 2, torch.float32)
    ids = torch.tensor([[3, 5]] * 20, device=DEVICE)  # experts 3 and 5 get all 20, the other six none
    out = fused_moe(x, w13, w2, weights, ids, plan=PLANS[path])
    assert rel_error(out, ref_fused_moe(x, w13, w2, weights, ids)) < tolerance(torch.float32)


@pytest.mark.parametrize("path", PLANS)
def test_another_ranks_experts_contribute_nothing(path):
    """Expert parallelism: this rank holds experts 4..7 of 8; tokens routed elsewhere get
    only their local experts' share (zero when none is local)."""
    x, w13, w2, weights, ids = _inputs(24, 32, 16, 8, 2, torch.float32, seed=3)
    ids[0] = torch.tensor([0, 1])  # nothing here for token 0
    local = slice(4, 8)
    out = fused_moe(x, w13[local].contiguous(), w2[local].contiguous(), weights, ids, first_expert=4,
                    plan=PLANS[path])
    ref = ref_fused_moe(x, w13[local], w2[local], weights, ids, first_expert=4)
    assert rel_error(out, ref) < tolerance(torch.float32)
    assert (out[0] == 0).all()


@pytest.mark.parametrize(("num_pairs", "num_experts", "first_expert", "block_m"), [
    (1, 4, 0, 16), (37, 8, 0, 16), (2500, 16, 0, 64), (300, 8, 4, 32), (64, 128, 0, 16),
])
def test_align_puts_each_local_pair_once_in_a_block_of_its_expert(num_pairs, num_experts, first_expert, block_m):
    """The grouped path's layout: every pair routed to this rank's experts exactly once, in a
    block whose expert is its own; every other slot padding (num_pairs); each expert's run
    padded to BLOCK_M and the runs in expert order; blocks past the runs -1."""
    gen = torch.Generator().manual_seed(num_pairs)
    ids = torch.randint(0, 2 * num_experts, (num_pairs,), generator=gen)
    ids[: num_pairs // 3] = ids[0]  # one expert far busier than the rest
    pair_ids, block_expert = align_by_expert(ids.to(DEVICE), num_experts, first_expert, block_m)
    pair_ids, block_expert = pair_ids.cpu(), block_expert.cpu()
    local = ids - first_expert
    mine = (local >= 0) & (local < num_experts)
    assert pair_ids.numel() == block_expert.numel() * block_m
    slot_expert = block_expert.repeat_interleave(block_m)
    real = pair_ids < num_pairs
    assert sorted(pair_ids[real].tolist()) == torch.nonzero(mine).flatten().tolist()
    assert (slot_expert[real] == local[pair_ids[real].long()]).all()
    assert (pair_ids[~real] == num_pairs).all()
    counts = torch.bincount(local[mine], minlength=num_experts)
    runs = (counts + block_m - 1) // block_m
    expected = torch.repeat_interleave(torch.arange(num_experts), runs)
    used = int(runs.sum())
    assert block_expert[:used].tolist() == expected.tolist() and (block_expert[used:] == -1).all()


def test_the_engines_cpu_path_is_the_same_function():
    x, w13, w2, weights, ids = _inputs(17, 32, 16, 8, 2, torch.float32, seed=5)
    got = experts_reference(x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu())
    assert rel_error(got, ref_fused_moe(x, w13, w2, weights, ids)) < tolerance(torch.float32)
    assert rel_error(fused_moe(x, w13, w2, weights, ids).cpu(), got) < tolerance(torch.float32)


def _fp8_experts(w: torch.Tensor, blocked: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[E, rows, K] -> (e4m3 weights, float32 scales, their dequantized float32 value): each
    output channel's amax / 448 ([E, rows, 1], engine.models.fp8's online quantization), or
    each 128 x 128 block's ([E, ceil(rows/128), ceil(K/128)], the edge blocks partial)."""
    w = w.float()
    if not blocked:
        scale = w.abs().amax(dim=2, keepdim=True) / 448.0
        full = scale
    else:
        e, n, k = w.shape
        padded = torch.zeros(e, -(-n // 128) * 128, -(-k // 128) * 128, device=w.device)
        padded[:, :n, :k] = w.abs()
        scale = padded.reshape(e, padded.shape[1] // 128, 128, padded.shape[2] // 128, 128).amax(dim=(2, 4)) / 448.0
        full = scale.repeat_interleave(128, 1)[:, :n].repeat_interleave(128, 2)[:, :, :k]
    q = (w / full).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q, scale.contiguous(), q.float() * full


@pytest.mark.parametrize("path", PLANS)
@pytest.mark.parametrize(("num_tokens", "first_expert"), [(3, 0), (12, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_experts_match_the_reference_on_their_dequantized_weights(path, num_tokens, first_expert, dtype):
    """FP8 experts with per-channel scales (and, second case, another rank's experts): the
    kernels widen each weight tile and scale each column once; the reference multiplies x by
    the dequantized weights. Only rounding order differs: the dtype's usual bound."""
    x, w13, w2, weights, ids = _inputs(num_tokens, 32, 16, 8, 2, dtype, seed=7)
    local = slice(first_expert, first_expert + 4)
    q13, s13, d13 = _fp8_experts(w13[local])
    q2, s2, d2 = _fp8_experts(w2[local])
    out = fused_moe(x, q13, q2, weights, ids, first_expert, PLANS[path], w13_scale=s13, w2_scale=s2)
    assert out.dtype == dtype
    ref = ref_fused_moe(x, d13, d2, weights, ids, first_expert=first_expert)
    assert rel_error(out, ref) < tolerance(dtype)


@pytest.mark.parametrize("path", PLANS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_experts_with_block_scales(path, dtype):
    """128 x 128 block scales: intermediate 128 (gate and up one block of rows each), hidden
    192 (a partial block of K for w13, of rows for w2); per-pair tiles of 256 columns span
    two blocks of K, grouped ones of 32 lie in one."""
    x, w13, w2, weights, ids = _inputs(6, 192, 128, 4, 2, dtype, seed=9)
    q13, s13, d13 = _fp8_experts(w13, blocked=True)
    q2, s2, d2 = _fp8_experts(w2, blocked=True)
    plan = Plan(False, Tile(8, 256), Tile(16, 64)) if path == "per_pair" else GROUPED
    out = fused_moe(x, q13, q2, weights, ids, plan=plan, w13_scale=s13, w2_scale=s2, blocked=True)
    assert rel_error(out, ref_fused_moe(x, d13, d2, weights, ids)) < tolerance(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 16, 512])
def test_fp8_experts_at_qwen3_30b_a3b_shape(num_tokens):
    """Qwen3-30B-A3B's experts (128, hidden 2048, intermediate 768, top 8) in FP8, bfloat16 x,
    both paths as plan_for picks them."""
    x, w13, w2, weights, ids = _inputs(num_tokens, 2048, 768, 128, 8, torch.bfloat16, seed=11)
    q13, s13, d13 = _fp8_experts(w13)
    q2, s2, d2 = _fp8_experts(w2)
    out = fused_moe(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2)
    assert rel_error(out, ref_fused_moe(x, d13, d2, weights, ids)) < tolerance(torch.bfloat16)


def test_fp8_experts_without_their_scales_are_refused():
    x, w13, w2, weights, ids = _inputs(4, 32, 16, 4, 2, torch.float32)
    q13, s13, _ = _fp8_experts(w13)
    q2, _, _ = _fp8_experts(w2)
    with pytest.raises(ValueError, match=r"w2_scale must be a contiguous float32 \[4, 32, 1\]"):
        fused_moe(x, q13, q2, weights, ids, w13_scale=s13)
    with pytest.raises(ValueError, match="scaled weights must be"):
        fused_moe(x, w13, w2, weights, ids, w13_scale=s13, w2_scale=s13)
    with pytest.raises(ValueError, match=r"intermediate size \(16\) to be a multiple of 128"):
        fused_moe(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s13, blocked=True)
    x, w13, w2, weights, ids = _inputs(4, 32, 128, 4, 2, torch.float32)
    (q13, s13, _), (q2, s2, _) = _fp8_experts(w13, blocked=True), _fp8_experts(w2, blocked=True)
    with pytest.raises(ValueError, match="block scales need grouped tiles of block_k <= 128"):
        fused_moe(x, q13, q2, weights, ids, plan=Plan(True, Tile(32, 256), Tile(32, 32)), w13_scale=s13,
                  w2_scale=s2, blocked=True)


def test_no_tokens():
    x, w13, w2, weights, ids = _inputs(0, 32, 16, 4, 2, torch.float32)
    assert fused_moe(x, w13, w2, weights, ids).shape == (0, 32)


@pytest.mark.parametrize(("change", "match"), [
    (lambda a: {**a, "w13": a["w13"][:, :, :16]}, "w13 must be a contiguous"),
    (lambda a: {**a, "w2": a["w2"].transpose(1, 2)}, "w2 must be a contiguous"),
    (lambda a: {**a, "w13": a["w13"].half()}, "x's dtype"),
    (lambda a: {**a, "ids": a["ids"][:, :1]}, "ids and weights"),
])
def test_bad_input_is_refused_by_name(change, match):
    x, w13, w2, weights, ids = _inputs(4, 32, 16, 4, 2, torch.float32)
    args = change(dict(x=x, w13=w13, w2=w2, weights=weights, ids=ids))
    with pytest.raises(ValueError, match=match):
        fused_moe(**args)


def test_a_bad_tile_is_refused_by_name():
    with pytest.raises(ValueError, match=r"gate_up.block_m must be a power of two >= 16"):
        Plan(True, Tile(32, 32, block_m=24), Tile(32, 32))
    with pytest.raises(ValueError, match=r"down.block_n must be a power of two >= 1"):
        Plan(False, Tile(8, 16), Tile(6, 16))


def test_every_plan_is_fitted_to_hoppers_shared_memory_at_every_dtype():
    """The swept plans are for 2-byte x: they stand as they are there; in float32 the
    256-token plan needs the 417,792 bytes an H100 refused (issue 53) and is shrunk to fit."""
    plans = [plan for table in module._TUNED.values() for _, plan in table] + [module.PAIRS, module.GROUPED]
    for plan in plans:
        assert fit_plan(plan, 2, HOPPER_SHARED) == plan
        for size in (1, 2, 4):
            fitted = fit_plan(plan, size, HOPPER_SHARED)
            assert shared_memory_bytes(fitted, size) <= HOPPER_SHARED
            assert fitted.grouped == plan.grouped
    qwen3_256 = plan_for(256, 128, 2048, 768, 8)
    assert shared_memory_bytes(qwen3_256, 4) == 417_792
    assert fit_plan(qwen3_256, 4, HOPPER_SHARED).gate_up == Tile(128, 128, 4, 16, 2)  # one stage less: 139,264


def test_fitting_shrinks_the_pipeline_then_the_tiles_and_refuses_what_cannot_fit():
    plan = Plan(True, Tile(128, 128, 4, 64, 4), Tile(64, 64, 4, 64, 3))
    need = shared_memory_bytes(plan, 4)
    fitted = fit_plan(plan, 4, need // 4)
    assert fitted.gate_up.num_stages == 2 and fitted.gate_up.block_k < 128
    assert shared_memory_bytes(fitted, 4) <= need // 4
    with pytest.raises(ValueError, match="no tile fits 1,000 bytes of shared memory at 4-byte elements"):
        fit_plan(plan, 4, 1000)
    assert shared_memory_limit(torch.device("cpu")) is None  # the interpreter: nothing to fit


def test_few_pairs_run_per_pair_and_many_grouped_where_no_sweep_says():
    assert not plan_for(1, 64, 32, 16, 8).grouped and plan_for(512, 64, 32, 16, 8).grouped


def test_a_table_swept_at_one_token_keeps_the_rules_above_it():
    """DeepSeek-V2-Lite's table has its one-token sweep; 2-10 tokens (up to 60 pairs) run the
    rules' per-pair plan and more the grouped one, not the one-token tiles."""
    v2_lite = (64, 2048, 1408, 6)
    assert plan_for(1, *v2_lite) == Plan(False, Tile(16, 256, 4), Tile(2, 512, 4))
    assert plan_for(10, *v2_lite) == module.PAIRS == plan_for(10, 64, 32, 16, 6)
    assert plan_for(11, *v2_lite) == module.GROUPED and plan_for(4096, *v2_lite) == module.GROUPED


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "renormalize"), [
    (1, 4, 1, False), (7, 8, 2, True), (3, 60, 4, False), (5, 128, 8, True), (2, 6, 6, True),
])
def test_topk_route_is_softmax_then_topk(num_tokens, num_experts, top_k, renormalize):
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(num_experts)).to(DEVICE)
    weights, ids = topk_route(logits.half(), top_k, renormalize)
    probs = torch.softmax(logits.half().double(), dim=-1)
    want, want_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        want = want / want.sum(dim=-1, keepdim=True)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids.cpu(), want_ids.cpu())
    torch.testing.assert_close(weights.double().cpu(), want.cpu(), rtol=1e-5, atol=1e-6)


def test_topk_route_takes_the_lowest_id_among_equal_experts():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0]], device=DEVICE)
    _, ids = topk_route(logits, 3, renormalize=False)
    assert ids.tolist() == [[1, 3, 4]]


def test_topk_route_refuses_a_top_k_past_the_experts():
    with pytest.raises(ValueError, match="top_k must be in 1..4"):
        topk_route(torch.zeros(2, 4, device=DEVICE), 5, renormalize=True)


@pytest.mark.gpu
@pytest.mark.parametrize(("num_tokens", "hidden", "inter", "num_experts", "top_k"), [
    (1, 2048, 768, 128, 8), (64, 2048, 768, 128, 8), (256, 2048, 768, 128, 8),  # Qwen3-30B-A3B
    (1, 4096, 14336, 8, 2), (128, 4096, 14336, 8, 2),  # Mixtral-8x7B
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path", ["tuned", *PLANS])
def test_fused_moe_gpu_real_sizes(num_tokens, hidden, inter, num_experts, top_k, dtype, path):
    x, w13, w2, weights, ids = _inputs(num_tokens, hidden, inter, num_experts, top_k, dtype)
    out = fused_moe(x, w13, w2, weights, ids, plan=PLANS.get(path))
    assert rel_error(out, ref_fused_moe(x, w13, w2, weights, ids)) < tolerance(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 16, 256, 2048])
def test_fused_moe_gpu_float32_at_qwen3_30b_a3b_shape(num_tokens):
    """float32 x at Qwen3-30B-A3B's expert shape on the device's plans, fitted to its shared
    memory (issue 53: the 256-token plan asked for 417,792 bytes, an H100 has 232,448)."""
    x, w13, w2, weights, ids = _inputs(num_tokens, 2048, 768, 128, 8, torch.float32, seed=5)
    out = fused_moe(x, w13, w2, weights, ids)
    assert rel_error(out, ref_fused_moe(x, w13, w2, weights, ids)) < tolerance(torch.float32)


@pytest.mark.gpu
def test_a_named_plan_past_the_devices_shared_memory_is_refused_before_launch():
    x, w13, w2, weights, ids = _inputs(256, 2048, 768, 128, 8, torch.float32)
    plan = Plan(True, Tile(128, 128, 4, 16, 4), Tile(128, 128, 4, 16, 3))
    assert shared_memory_bytes(plan, 4) > shared_memory_limit(x.device)
    with pytest.raises(ValueError, match="bytes of shared memory at torch.float32, more than the device's"):
        fused_moe(x, w13, w2, weights, ids, plan=plan)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 64, 256])
def test_fused_moe_under_a_cuda_graph_is_the_eager_result(num_tokens):
    """Routing and experts captured in one graph (as a decode step is) replay the eager result
    on new inputs written into the captured buffers: no host sync, no size read back."""
    x, w13, w2, _, _ = _inputs(num_tokens, 2048, 768, 128, 8, torch.bfloat16)
    logits = torch.randn(num_tokens, 128, device=DEVICE, dtype=torch.bfloat16)

    def step() -> torch.Tensor:
        weights, ids = route(logits, 8, renormalize=True)
        return fused_moe(x, w13, w2, weights, ids)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    x.copy_(torch.randn_like(x))
    logits.copy_(torch.randn_like(logits))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, step())
