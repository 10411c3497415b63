"""Fused Mixture-of-Experts: each token's top-k experts' SwiGLU MLPs, summed with the
router's weights (vLLM's and SGLang's fused_moe, simpler), and the router's top-k itself.

Two paths, picked by the number of (token, slot) pairs:
- Few pairs (a decode step of a small batch): every pair's experts are (nearly) all
  different, so the layer is a weight read. A program of `_pair_gate_up_kernel` takes one
  pair and BLOCK_N columns of its expert's gate and up projections, GEMV-style (elementwise
  products in float32, one reduction at the end), and stores silu(gate) * up; a program of
  `_token_down_kernel` takes one token and BLOCK_N rows of the down projection and sums its
  k experts' rows, weighted: no sorting, no padding, no partial sums, two launches.
- Many pairs (prefill, large batches): grouped GEMMs. The pairs are grouped by expert and
  each expert's run padded to a multiple of BLOCK_M (`align_by_expert`: a count, the runs' offsets and
  a scatter, three small kernels without a host sync: every size is fixed by the token count,
  so a CUDA graph can hold it). A program of
  `_gate_up_silu_kernel` takes BLOCK_M pairs of one expert and BLOCK_N columns of its gate
  and up projections (tl.dot over the hidden dimension) and stores silu(gate) * up; then
  `_down_kernel` multiplies that by the expert's down projection and the pair's routing
  weight; the k slots of a token are summed last.

Tile sizes and the path come from `moe_plan.plan_for`: a table swept on the H200
(`benchmarks/moe_sweep.py`, results in benchmarks/RESULTS.md) for the shapes it timed,
rules elsewhere; then `fit_plan` shrinks the tiles to the device's shared memory at x's
dtype (the table is for 2-byte x: float32 needs twice its bytes, more than a Hopper
program's 227 KB at the sweep's deepest pipelines). A plan the caller names is refused
before any launch if it does not fit.

Experts outside this rank's (expert parallelism: ids first_expert .. first_expert + E - 1
are here) contribute nothing; blocks past the padded runs exit at once.

FP8 experts (e4m3 weights with float32 scales) run the same kernels: a weight tile is
widened to x's dtype as it is loaded (exact). Scales per output channel (`w13_scale`
[E, 2I, 1], `w2_scale` [E, H, 1]) multiply each output column's sum once at the end; per
128 x 128 block ([E, 2I/128, ceil(H/128)], [E, ceil(H/128), I/128]: Qwen3-MoE-FP8's layout,
I a multiple of 128 so that up's rows start on a block) they multiply each weight tile
(per-pair kernels: the tile's scales gathered from the few blocks it covers) or each K tile's
partial product (grouped kernels: a K tile lies in one block, BLOCK_K <= 128).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels import _pdl
from pdserve.kernels.moe_plan import Plan, fit_plan, plan_for, shared_memory_bytes, shared_memory_limit
from pdserve.kernels.moe_routing import align_by_expert

PER_CHANNEL, PER_BLOCK = 1, 2  # the kernels' SCALE: 0 for weights in x's dtype
SCALE_BLOCK = 128  # the kernels' 128s


@triton.jit
def _tile_scales(s_ptr, rows, ks, mask, stride_sr):
    """The block scales of each element of a weight tile [rows, ks] (one expert's s_ptr)."""
    return tl.load(s_ptr + (rows // 128).to(tl.int64)[:, None] * stride_sr + (ks // 128)[None, :], mask=mask,
                   other=0.0)


@triton.jit
def _pair_gate_up_kernel(
    x_ptr,            # [T, H]
    w13_ptr,          # [E, 2I, H]
    out_ptr,          # [T * k, I]: silu(gate) * up of every pair of this rank's experts
    ids_ptr,          # [T * k]: each pair's expert (the model's id)
    s13_ptr,          # FP8 w13's float32 scales, [E, 2I, 1] or [E, 2I/128, ceil(H/128)]; a dummy when not SCALE
    first_expert, num_local, top_k, hidden, inter,
    stride_xt, stride_we, stride_wn, stride_ot, stride_se, stride_sr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE: tl.constexpr, PDL: tl.constexpr,
):
    pair = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < inter
    _pdl.wait(PDL)
    expert = tl.load(ids_ptr + pair) - first_expert
    if (expert < 0) | (expert >= num_local):
        return
    x = x_ptr + (pair // top_k).to(tl.int64) * stride_xt
    gate = w13_ptr + expert.to(tl.int64) * stride_we + rows.to(tl.int64)[:, None] * stride_wn
    up = gate + inter * stride_wn
    acc_gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        xk = tl.load(x + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        mask = row_ok[:, None] & k_ok[None, :]
        wg = tl.load(gate + ks[None, :], mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        wu = tl.load(up + ks[None, :], mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        if SCALE == 2:
            s = s13_ptr + expert.to(tl.int64) * stride_se
            wg *= _tile_scales(s, rows, ks, mask, stride_sr)
            wu *= _tile_scales(s, inter + rows, ks, mask, stride_sr)
        acc_gate += wg * xk
        acc_up += wu * xk
    g = tl.sum(acc_gate, axis=1)
    u = tl.sum(acc_up, axis=1)
    if SCALE == 1:
        scales = s13_ptr + expert.to(tl.int64) * stride_se + rows
        g *= tl.load(scales, mask=row_ok, other=0.0)
        u *= tl.load(scales + inter, mask=row_ok, other=0.0)
    act = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + pair.to(tl.int64) * stride_ot + rows, act.to(out_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _token_down_kernel(
    act_ptr,          # [T * k, I]
    w2_ptr,           # [E, H, I]
    weights_ptr,      # [T * k] float32
    ids_ptr,          # [T * k]
    out_ptr,          # [T, H]: the token's weighted sum over its k experts
    s2_ptr,           # FP8 w2's float32 scales, [E, H, 1] or [E, ceil(H/128), I/128]; a dummy when not SCALE
    first_expert, num_local, hidden, inter,
    stride_at, stride_we, stride_wn, stride_ot, stride_se, stride_sr,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE: tl.constexpr, PDL: tl.constexpr,
):
    token = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < hidden
    _pdl.wait(PDL)
    y = tl.zeros((BLOCK_N,), dtype=tl.float32)
    # The k experts unrolled, another rank's masked rather than branched around: the loads of
    # every expert can be in flight at once.
    for slot in tl.static_range(TOP_K):
        pair = token * TOP_K + slot
        expert = tl.load(ids_ptr + pair) - first_expert
        local = (expert >= 0) & (expert < num_local)
        w = w2_ptr + tl.where(local, expert, 0).to(tl.int64) * stride_we + rows.to(tl.int64)[:, None] * stride_wn
        a = act_ptr + pair.to(tl.int64) * stride_at
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in tl.range(0, inter, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < tl.where(local, inter, 0)  # a tensor compare: nothing read for another rank's
            ak = tl.load(a + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            mask = row_ok[:, None] & k_ok[None, :]
            wk = tl.load(w + ks[None, :], mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            if SCALE == 2:
                wk *= _tile_scales(s2_ptr + tl.where(local, expert, 0).to(tl.int64) * stride_se, rows, ks, mask,
                                   stride_sr)
            acc += wk * ak
        part = tl.sum(acc, axis=1)
        if SCALE == 1:
            scale_ptrs = s2_ptr + tl.where(local, expert, 0).to(tl.int64) * stride_se + rows
            part *= tl.load(scale_ptrs, mask=row_ok, other=0.0)
        y += tl.where(local, tl.load(weights_ptr + pair), 0.0) * part
    tl.store(out_ptr + token.to(tl.int64) * stride_ot + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)


@triton.jit(do_not_specialize=["num_pairs"])  # it changes with every step's tokens
def _gate_up_silu_kernel(
    x_ptr,            # [T, H]: the tokens
    w13_ptr,          # [E, 2I, H]: each expert's gate rows, then its up rows
    out_ptr,          # [T * k, I]: silu(gate) * up of every (token, slot) pair
    pair_ids_ptr,     # [M_max] int32: pairs grouped by expert, each run padded with T * k
    block_expert_ptr,  # [M_max / BLOCK_M] int32: the expert of each block of pairs, -1 past the last
    s13_ptr,          # FP8 w13's float32 scales, [E, 2I, 1] or [E, 2I/128, ceil(H/128)]; a dummy when not SCALE
    num_pairs, top_k, hidden, inter,
    stride_xt, stride_we, stride_wn, stride_ot, stride_se, stride_sr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SCALE: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    pairs = tl.load(pair_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_ok = pairs < num_pairs
    tokens = (pairs // top_k).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    w = w13_ptr + expert.to(tl.int64) * stride_we
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(x_ptr + tokens[:, None] * stride_xt + ks[None, :], mask=pair_ok[:, None] & k_ok[None, :],
                    other=0.0)
        wmask = k_ok[:, None] & col_ok[None, :]
        gate = tl.load(w + cols[None, :] * stride_wn + ks[:, None], mask=wmask, other=0.0)  # [BK, BN]
        up = tl.load(w + (inter + cols[None, :]) * stride_wn + ks[:, None], mask=wmask, other=0.0)
        if SCALE == 2:  # each K tile's product times its block's scales (the tile lies in one block)
            s = s13_ptr + expert.to(tl.int64) * stride_se + (k0 // 128)
            sg = tl.load(s + (cols // 128) * stride_sr, mask=col_ok, other=0.0)
            su = tl.load(s + ((inter + cols) // 128) * stride_sr, mask=col_ok, other=0.0)
            acc_gate += tl.dot(a, gate.to(a.dtype), input_precision=DOT_PRECISION) * sg[None, :]
            acc_up += tl.dot(a, up.to(a.dtype), input_precision=DOT_PRECISION) * su[None, :]
        else:
            acc_gate = tl.dot(a, gate.to(a.dtype), acc_gate, input_precision=DOT_PRECISION)
            acc_up = tl.dot(a, up.to(a.dtype), acc_up, input_precision=DOT_PRECISION)
    if SCALE == 1:
        scales = s13_ptr + expert.to(tl.int64) * stride_se + cols
        acc_gate *= tl.load(scales, mask=col_ok, other=0.0)[None, :]
        acc_up *= tl.load(scales + inter, mask=col_ok, other=0.0)[None, :]
    act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    out = out_ptr + pairs.to(tl.int64)[:, None] * stride_ot + cols[None, :]
    tl.store(out, act.to(out_ptr.dtype.element_ty), mask=pair_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(
    act_ptr,          # [T * k, I]
    w2_ptr,           # [E, H, I]
    weights_ptr,      # [T * k] float32: each pair's routing weight
    out_ptr,          # [T * k, H]: weight x down(act) of every pair of this rank's experts
    pair_ids_ptr, block_expert_ptr,
    s2_ptr,           # FP8 w2's float32 scales, [E, H, 1] or [E, ceil(H/128), I/128]; a dummy when not SCALE
    num_pairs, hidden, inter,
    stride_at, stride_we, stride_wn, stride_ot, stride_se, stride_sr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SCALE: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    pairs = tl.load(pair_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_ok = pairs < num_pairs
    rows = pairs.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    w = w2_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(act_ptr + rows[:, None] * stride_at + ks[None, :], mask=pair_ok[:, None] & k_ok[None, :],
                    other=0.0)
        b = tl.load(w + cols[None, :] * stride_wn + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if SCALE == 2:
            s = tl.load(s2_ptr + expert.to(tl.int64) * stride_se + (cols // 128) * stride_sr + k0 // 128,
                        mask=col_ok, other=0.0)
            acc += tl.dot(a, b.to(a.dtype), input_precision=DOT_PRECISION) * s[None, :]
        else:
            acc = tl.dot(a, b.to(a.dtype), acc, input_precision=DOT_PRECISION)
    if SCALE == 1:
        acc *= tl.load(s2_ptr + expert.to(tl.int64) * stride_se + cols, mask=col_ok, other=0.0)[None, :]
    weight = tl.load(weights_ptr + rows, mask=pair_ok, other=0.0)
    out = out_ptr + rows[:, None] * stride_ot + cols[None, :]
    tl.store(out, (acc * weight[:, None]).to(out_ptr.dtype.element_ty), mask=pair_ok[:, None] & col_ok[None, :])


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
              first_expert: int = 0, plan: Plan | None = None, *, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None, blocked: bool = False) -> torch.Tensor:
    """sum over k of weights[t, k] * expert_{ids[t, k]}(x[t]), an expert being the SwiGLU MLP
    down(silu(gate(x)) * up(x)), over the experts this rank holds.

    Args:
        x: [T, H], last dim contiguous; float32, float16 or bfloat16.
        w13: [E, 2I, H], contiguous, x's dtype: expert e's gate rows, then its up rows.
        w2: [E, H, I], contiguous, x's dtype.
        weights: [T, k] routing weights (any float dtype; used in float32).
        ids: [T, k] int: each token's experts; those outside first_expert .. first_expert + E - 1
            (another rank's, under expert parallelism) contribute nothing.
        first_expert: the model's id of w13[0].
        plan: the path and tiles; `plan_for` the call's shape when None.
        w13_scale, w2_scale: FP8 experts' scales, float32, contiguous: [E, 2I, 1] and [E, H, 1]
            (one per output channel), or with `blocked` [E, 2I/128, ceil(H/128)] and
            [E, ceil(H/128), I/128] (one per 128 x 128 block; I a multiple of 128). w13 and w2
            are then float8_e4m3fn, both scales given.

    Returns:
        A new [T, H] in x's dtype.

    No host sync; every size follows from T, k and E: safe to capture in a CUDA graph.
    """
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"fused_moe: x must be [T, H] with its last dim contiguous, got {tuple(x.shape)}")
    num_tokens, hidden = x.shape
    if w13.dim() != 3 or w13.shape[2] != hidden or w13.shape[1] % 2 or not w13.is_contiguous():
        raise ValueError(f"fused_moe: w13 must be a contiguous [E, 2I, {hidden}], got {tuple(w13.shape)}")
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    if w2.shape != (num_experts, hidden, inter) or not w2.is_contiguous():
        raise ValueError(f"fused_moe: w2 must be a contiguous [{num_experts}, {hidden}, {inter}], "
                         f"got {tuple(w2.shape)}")
    _check_weight_dtypes(x, w13, w2, w13_scale, w2_scale, blocked)
    if ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != num_tokens:
        raise ValueError(f"fused_moe: ids and weights must both be [{num_tokens}, k], got {tuple(ids.shape)} "
                         f"and {tuple(weights.shape)}")
    top_k = ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros((num_tokens, hidden), dtype=x.dtype, device=x.device)
    plan = _fitted(plan, x, num_experts, inter, top_k)
    if blocked and plan.grouped and max(plan.gate_up.block_k, plan.down.block_k) > SCALE_BLOCK:
        raise ValueError(f"fused_moe: block scales need grouped tiles of block_k <= {SCALE_BLOCK}, got {plan}")
    weights = weights.reshape(-1).to(torch.float32)
    ids = ids.reshape(-1)
    act = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    scales = None if w13_scale is None or w2_scale is None else (w13_scale, w2_scale, blocked)
    if not plan.grouped:
        return _per_pair(x, w13, w2, weights, ids, act, first_expert, top_k, plan, scales)
    return _grouped(x, w13, w2, weights, ids, act, first_expert, top_k, plan, scales)


def _fitted(plan: Plan | None, x: torch.Tensor, num_experts: int, inter: int, top_k: int) -> Plan:
    """The call's plan: `plan_for`'s, fitted to x's device and dtype, or the caller's, refused
    before any launch if it needs more shared memory than the device has."""
    limit = shared_memory_limit(x.device)
    if plan is None:
        plan = plan_for(x.shape[0], num_experts, x.shape[1], inter, top_k)
        return plan if limit is None else fit_plan(plan, x.element_size(), limit)
    if limit is not None and (need := shared_memory_bytes(plan, x.element_size())) > limit:
        raise ValueError(f"fused_moe: plan {plan} needs ~{need:,} bytes of shared memory at {x.dtype}, more than "
                         f"the device's {limit:,}: smaller tiles or fewer stages")
    return plan


def _check_weight_dtypes(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None,
                         w2_scale: torch.Tensor | None, blocked: bool) -> None:
    """Weights of x's dtype without scales, or FP8 ones with both scales (per channel or block)."""
    if w13_scale is None and w2_scale is None:
        if w13.dtype != x.dtype or w2.dtype != x.dtype:
            raise ValueError(f"fused_moe: weights must be x's dtype {x.dtype}, got {w13.dtype} and {w2.dtype}")
        return
    fp8 = torch.float8_e4m3fn
    if w13.dtype != fp8 or w2.dtype != fp8:
        raise ValueError(f"fused_moe: scaled weights must be {fp8}, got {w13.dtype} and {w2.dtype}")
    if blocked and w2.shape[2] % SCALE_BLOCK:
        raise ValueError(f"fused_moe: block scales need the intermediate size ({w2.shape[2]}) to be a multiple of "
                         f"{SCALE_BLOCK} (up's rows start on a block)")
    for name, scale, w in (("w13_scale", w13_scale, w13), ("w2_scale", w2_scale, w2)):
        want = (w.shape[0], -(-w.shape[1] // SCALE_BLOCK), -(-w.shape[2] // SCALE_BLOCK)) if blocked else (
            *w.shape[:2], 1)
        if scale is None or scale.shape != want or scale.dtype != torch.float32 or not scale.is_contiguous():
            raise ValueError(f"fused_moe: {name} must be a contiguous float32 {list(want)}, got "
                             f"{None if scale is None else (tuple(scale.shape), scale.dtype)}")


def _scale_args(w13: torch.Tensor, w2: torch.Tensor,
                scales: tuple[torch.Tensor, torch.Tensor, bool] | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(w13's scales, w2's scales, the kernels' SCALE): the weights as dummies when unscaled."""
    if scales is None:
        return w13, w2, 0
    s13, s2, blocked = scales
    return s13, s2, PER_BLOCK if blocked else PER_CHANNEL


def _per_pair(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
              act: torch.Tensor, first_expert: int, top_k: int, plan: Plan,
              scales: tuple[torch.Tensor, torch.Tensor, bool] | None) -> torch.Tensor:
    num_tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], act.shape[1]
    out = torch.empty_like(x)
    pdl = _pdl.pdl(x)
    up, down = plan.gate_up, plan.down
    s13, s2, scale = _scale_args(w13, w2, scales)
    _pair_gate_up_kernel[(act.shape[0], triton.cdiv(inter, up.block_n))](
        x, w13, act, ids, s13, first_expert, num_experts, top_k, hidden, inter,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0), s13.stride(0), s13.stride(1),
        BLOCK_N=up.block_n, BLOCK_K=up.block_k, SCALE=scale, PDL=pdl, num_warps=up.num_warps,
        num_stages=up.num_stages, launch_pdl=pdl)
    _token_down_kernel[(num_tokens, triton.cdiv(hidden, down.block_n))](
        act, w2, weights, ids, out, s2, first_expert, num_experts, hidden, inter,
        act.stride(0), w2.stride(0), w2.stride(1), out.stride(0), s2.stride(0), s2.stride(1),
        TOP_K=top_k, BLOCK_N=down.block_n, BLOCK_K=down.block_k, SCALE=scale, PDL=pdl,
        num_warps=down.num_warps, num_stages=down.num_stages, launch_pdl=pdl)
    return out


def _grouped(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
             act: torch.Tensor, first_expert: int, top_k: int, plan: Plan,
             scales: tuple[torch.Tensor, torch.Tensor, bool] | None) -> torch.Tensor:
    num_tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], act.shape[1]
    num_pairs = act.shape[0]
    up, down = plan.gate_up, plan.down
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # float32 exact, as torch without TF32
    s13, s2, scale = _scale_args(w13, w2, scales)
    pair_ids, block_expert = align_by_expert(ids, num_experts, first_expert, up.block_m)
    _gate_up_silu_kernel[(block_expert.shape[0], triton.cdiv(inter, up.block_n))](
        x, w13, act, pair_ids, block_expert, s13, num_pairs, top_k, hidden, inter,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0), s13.stride(0), s13.stride(1),
        BLOCK_M=up.block_m, BLOCK_N=up.block_n, BLOCK_K=up.block_k, DOT_PRECISION=precision,
        SCALE=scale, num_warps=up.num_warps,
        num_stages=up.num_stages,
    )
    if down.block_m != up.block_m:
        pair_ids, block_expert = align_by_expert(ids, num_experts, first_expert, down.block_m)
    per_pair = torch.zeros((num_pairs, hidden), dtype=x.dtype, device=x.device)
    _down_kernel[(block_expert.shape[0], triton.cdiv(hidden, down.block_n))](
        act, w2, weights, per_pair, pair_ids, block_expert, s2, num_pairs, hidden, inter,
        act.stride(0), w2.stride(0), w2.stride(1), per_pair.stride(0), s2.stride(0), s2.stride(1),
        BLOCK_M=down.block_m, BLOCK_N=down.block_n, BLOCK_K=down.block_k, DOT_PRECISION=precision,
        SCALE=scale,
        num_warps=down.num_warps,
        num_stages=down.num_stages,
    )
    return torch.sum(per_pair.view(num_tokens, top_k, hidden), dim=1)
