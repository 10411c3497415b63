"""A Mixture-of-Experts layer's routing on the GPU: the router's top-k (`topk_route`, one
launch for softmax, top-k and renormalization; `grouped_topk_route`, one launch for
DeepSeek's group-limited routers), and the grouped path's layout of the (token,
slot) pairs by expert (`align_by_expert`: a count, the runs' offsets, a scatter). No host sync in either:
every size follows from the token count, so a CUDA graph can hold them. `kernels.fused_moe`
runs the experts over that layout."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels import _pdl


@triton.jit
def _softmax(logits, ok):
    """float32 softmax over the `ok` lanes (torch's: exp(x - max) / sum); -inf elsewhere."""
    probs = tl.exp(logits - tl.max(logits, 0))
    return tl.where(ok, probs / tl.sum(probs, 0), float("-inf"))


@triton.jit
def _top_k(values, cols, TOP_K: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    """The TOP_K largest of `values` [BLOCK] (-inf: never chosen) and their lanes, largest
    first, the lowest lane among equals; slots past TOP_K hold 0."""
    slots = tl.arange(0, BLOCK_K)
    chosen = tl.zeros((BLOCK_K,), dtype=tl.float32)
    chosen_ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
    for slot in tl.static_range(TOP_K):
        best = tl.max(values, 0)
        best_id = tl.min(tl.where(values == best, cols, BLOCK), 0)
        chosen = tl.where(slots == slot, best, chosen)
        chosen_ids = tl.where(slots == slot, best_id.to(tl.int64), chosen_ids)
        values = tl.where(cols == best_id, float("-inf"), values)
    return chosen, chosen_ids


@triton.jit
def _row_logits(logits_ptr, token, stride_lt, num_experts, BLOCK_E: tl.constexpr, PDL: tl.constexpr):
    """Row `token` of the router's logits in float32, once the previous kernel's writes landed:
    (logits [BLOCK_E], -inf past num_experts; their lanes; which lanes are experts)."""
    cols = tl.arange(0, BLOCK_E)
    ok = cols < num_experts
    _pdl.wait(PDL)
    logits = tl.load(logits_ptr + token * stride_lt + cols, mask=ok, other=float("-inf")).to(tl.float32)
    return logits, cols, ok


@triton.jit
def _store_route(chosen, chosen_ids, weights_ptr, ids_ptr, token, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Row `token` of a routing's outputs [T, TOP_K]: the chosen experts' weights and ids."""
    slots = tl.arange(0, BLOCK_K)
    tl.store(weights_ptr + token * TOP_K + slots, chosen, mask=slots < TOP_K)
    tl.store(ids_ptr + token * TOP_K + slots, chosen_ids, mask=slots < TOP_K)


def _route_outputs(caller: str, router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A routing's (weights [T, k] float32, ids [T, k] int64), unfilled; the logits' rows checked."""
    if router_logits.stride(-1) != 1:
        raise ValueError(f"{caller}: the logits' last dim must be contiguous, got strides {router_logits.stride()}")
    num_tokens = router_logits.shape[0]
    return (torch.empty((num_tokens, top_k), dtype=torch.float32, device=router_logits.device),
            torch.empty((num_tokens, top_k), dtype=torch.int64, device=router_logits.device))


@triton.jit
def _topk_route_kernel(
    logits_ptr,       # [T, E]: the router's logits
    weights_ptr,      # [T, K] float32: the k largest softmax probabilities, renormalized if asked
    ids_ptr,          # [T, K] int64: their experts, largest first
    num_experts, stride_lt,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    token = tl.program_id(0)
    logits, cols, ok = _row_logits(logits_ptr, token, stride_lt, num_experts, BLOCK_E, PDL)
    chosen, chosen_ids = _top_k(_softmax(logits, ok), cols, TOP_K, BLOCK_E, BLOCK_K)
    if RENORMALIZE:
        chosen = chosen / tl.sum(tl.where(tl.arange(0, BLOCK_K) < TOP_K, chosen, 0.0), 0)
    _store_route(chosen, chosen_ids, weights_ptr, ids_ptr, token, TOP_K, BLOCK_K)


def topk_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> (weights [T, k] float32, expert ids [T, k] int64): softmax over every
    expert in float32, the k largest (the lowest id first among equal ones), renormalized to
    sum to 1 when asked. One launch per step, no host sync (the router of a decode step is
    otherwise five small kernels)."""
    num_tokens, num_experts = router_logits.shape
    weights, ids = _route_outputs("topk_route", router_logits, top_k)
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"topk_route: top_k must be in 1..{num_experts}, got {top_k}")
    if num_tokens:
        pdl = _pdl.pdl(router_logits)
        _topk_route_kernel[(num_tokens,)](
            router_logits, weights, ids, num_experts, router_logits.stride(0),
            TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_E=triton.next_power_of_2(num_experts),
            BLOCK_K=triton.next_power_of_2(top_k), PDL=pdl, launch_pdl=pdl)
    return weights, ids


@triton.jit
def _grouped_route_kernel(
    logits_ptr,       # [T, E]: the router's logits
    bias_ptr,         # [E]: the choice's correction bias (SIGMOID with HAS_BIAS only)
    weights_ptr,      # [T, K] float32: the chosen experts' scores (renormalized if asked) x scale
    ids_ptr,          # [T, K] int64: the chosen experts
    num_experts, group_size, num_groups, stride_lt, scale,
    TOP_K: tl.constexpr, TOPK_GROUP: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    token = tl.program_id(0)
    logits, cols, ok = _row_logits(logits_ptr, token, stride_lt, num_experts, BLOCK_E, PDL)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-logits))
        choice = scores
        if HAS_BIAS:
            choice = scores + tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        choice = tl.where(ok, choice, float("-inf"))
    else:
        scores = _softmax(logits, ok)
        choice = scores
    # [groups, experts]: each group's lanes; a group's score is its best (softmax) or the
    # sum of its two best (sigmoid, the first of equal ones taken once).
    groups = tl.arange(0, BLOCK_G)
    member = ((cols[None, :] // group_size) == groups[:, None]) & ok[None, :]
    grid = tl.where(member, choice[None, :], float("-inf"))
    group_scores = tl.max(grid, 1)
    if SIGMOID:
        first = tl.min(tl.where(grid == group_scores[:, None], cols[None, :], BLOCK_E), 1)
        group_scores += tl.max(tl.where(cols[None, :] == first[:, None], float("-inf"), grid), 1)
    group_scores = tl.where(groups < num_groups, group_scores, float("-inf"))
    _, kept = _top_k(group_scores, groups, TOPK_GROUP, BLOCK_G, BLOCK_G)
    kept_slots = tl.arange(0, BLOCK_G) < TOPK_GROUP
    is_kept = tl.max(((groups[:, None] == kept[None, :]) & kept_slots[None, :]).to(tl.int32), 1)
    in_kept = tl.max((member & (is_kept[:, None] > 0)).to(tl.int32), 0) > 0
    _, chosen_ids = _top_k(tl.where(in_kept, choice, float("-inf")), cols, TOP_K, BLOCK_E, BLOCK_K)
    # The weights are the chosen experts' scores without the bias.
    chosen = tl.sum(tl.where(cols[None, :] == chosen_ids[:, None], scores[None, :], 0.0), 1)
    slots = tl.arange(0, BLOCK_K)
    chosen = tl.where(slots < TOP_K, chosen, 0.0)
    if RENORMALIZE:
        chosen = chosen / (tl.sum(chosen, 0) + 1e-20)
    _store_route(chosen * scale, chosen_ids, weights_ptr, ids_ptr, token, TOP_K, BLOCK_K)


GROUPED_ROUTINGS = ("group_limited_greedy", "noaux_tc")


def grouped_topk_route(router_logits: torch.Tensor, routing: str, top_k: int, num_groups: int, topk_group: int,
                       renormalize: bool, scaling_factor: float,
                       correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's group-limited routers in one launch, transformers' float32 arithmetic:
    [T, E] logits -> (weights [T, k] float32, expert ids [T, k] int64, largest choice first).

    "group_limited_greedy" (V2): softmax scores; the topk_group groups (of num_groups equal
    runs of experts) whose best score is highest are kept, the top k of their experts chosen.
    "noaux_tc" (V3): sigmoid scores; the choice is by score + `correction_bias` [E], groups
    ranked by the sum of their two best biased scores. The weights are the chosen experts'
    scores without the bias, divided by their sum + 1e-20 when `renormalize`, times
    `scaling_factor`. Among equal scores (or group scores) the lowest id is taken. One launch,
    no host sync, sizes from T alone: a CUDA graph can hold it (the torch path is ~10 ops)."""
    if routing not in GROUPED_ROUTINGS:
        raise ValueError(f"grouped_topk_route: routing must be one of {GROUPED_ROUTINGS}, got {routing!r}")
    num_tokens, num_experts = router_logits.shape
    weights, ids = _route_outputs("grouped_topk_route", router_logits, top_k)
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(f"grouped_topk_route: num_groups {num_groups} must divide the {num_experts} experts")
    group_size = num_experts // num_groups
    if not 1 <= topk_group <= num_groups:
        raise ValueError(f"grouped_topk_route: topk_group must be in 1..{num_groups}, got {topk_group}")
    if not 1 <= top_k <= topk_group * group_size:
        raise ValueError(f"grouped_topk_route: top_k must be in 1..{topk_group * group_size} "
                         f"(the experts of topk_group groups), got {top_k}")
    sigmoid = routing == "noaux_tc"
    if sigmoid and group_size < 2:
        raise ValueError(f"grouped_topk_route: noaux_tc ranks groups by their two best experts; "
                         f"groups of {group_size} expert")
    if correction_bias is not None and (not sigmoid or correction_bias.shape != (num_experts,)
                                        or correction_bias.stride(0) != 1):
        raise ValueError(f"grouped_topk_route: correction_bias must be a contiguous [{num_experts}] tensor "
                         f"and only with noaux_tc; got {tuple(correction_bias.shape)} for {routing}")
    if num_tokens:
        pdl = _pdl.pdl(router_logits)
        bias = correction_bias if correction_bias is not None else weights
        _grouped_route_kernel[(num_tokens,)](
            router_logits, bias, weights, ids, num_experts, group_size, num_groups, router_logits.stride(0),
            float(scaling_factor), TOP_K=top_k, TOPK_GROUP=topk_group, SIGMOID=sigmoid,
            HAS_BIAS=correction_bias is not None, RENORMALIZE=renormalize,
            BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_G=triton.next_power_of_2(num_groups),
            BLOCK_K=triton.next_power_of_2(top_k), PDL=pdl, launch_pdl=pdl)
    return weights, ids


@triton.jit
def _count_kernel(
    ids_ptr,          # [T * k]: each pair's expert (the model's id)
    counts_ptr,       # [E] int32, zeroed: pairs per local expert
    num_pairs, first_expert, num_local,
    BLOCK: tl.constexpr, BINS: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < num_pairs
    expert = tl.load(ids_ptr + offs, mask=ok, other=0).to(tl.int32) - first_expert
    local = ok & (expert >= 0) & (expert < num_local)
    hist = tl.histogram(tl.where(local, expert, num_local), BINS)  # bin num_local: the others
    bins = tl.arange(0, BINS)
    tl.atomic_add(counts_ptr + bins, hist, mask=bins < num_local)


@triton.jit
def _offsets_kernel(
    counts_ptr,       # [E] int32: pairs per local expert
    cursor_ptr,       # [E] int32: out, each expert's first padded position (the scatter's cursors)
    block_expert_ptr,  # [num_blocks] int32: out, each block's expert, -1 past the runs
    pair_ids_ptr,     # [max_pairs] int32: out, every slot num_pairs (the padding) until the scatter
    num_local, num_pairs, num_blocks, max_pairs,
    BLOCK_M: tl.constexpr, BINS: tl.constexpr, ROWS: tl.constexpr, FILL: tl.constexpr,
):
    bins = tl.arange(0, BINS)
    ok = bins < num_local
    counts = tl.load(counts_ptr + bins, mask=ok, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(cursor_ptr + bins, ends - padded, mask=ok)
    for b0 in range(0, num_blocks, ROWS):
        blocks = b0 + tl.arange(0, ROWS)
        # A block's expert is the number of runs that end at or before its first slot.
        ended = (ends[None, :] <= (blocks * BLOCK_M)[:, None]) & ok[None, :]
        expert = tl.sum(ended.to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, tl.where(expert < num_local, expert, -1), mask=blocks < num_blocks)
    for p0 in range(0, max_pairs, FILL):
        slots = p0 + tl.arange(0, FILL)
        tl.store(pair_ids_ptr + slots, tl.full((FILL,), 0, tl.int32) + num_pairs, mask=slots < max_pairs)


@triton.jit
def _scatter_kernel(
    ids_ptr,          # [T * k]
    cursor_ptr,       # [E] int32: each expert's next free slot
    pair_ids_ptr,     # [max_pairs] int32: each local pair lands in its expert's run
    num_pairs, first_expert, num_local,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < num_pairs
    expert = tl.load(ids_ptr + offs, mask=ok, other=0).to(tl.int32) - first_expert
    local = ok & (expert >= 0) & (expert < num_local)
    slot = tl.atomic_add(cursor_ptr + tl.where(local, expert, 0), 1, mask=local)
    tl.store(pair_ids_ptr + slot, offs.to(tl.int32), mask=local)


def align_by_expert(ids: torch.Tensor, num_experts: int, first_expert: int,
                    block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair ids grouped by local expert, each expert's run padded to BLOCK_M with T*k; the
    expert of each block, -1 past the runs). Sizes depend on T*k and E only, so a CUDA graph
    can hold it. Three launches and a memset (a count, the runs' offsets, a scatter) where
    torch's sort and its bookkeeping took ~30 ops, which an eager prefill paid on the host at
    every layer. Within an expert's run the pairs are in no fixed order: a pair's row of the
    grouped GEMMs does not depend on the other rows of its block."""
    num_pairs = ids.numel()
    max_pairs = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m
    num_blocks = max_pairs // block_m
    counts = torch.zeros(num_experts, dtype=torch.int32, device=ids.device)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
    pair_ids = torch.empty(max_pairs, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=ids.device)
    block = 1024
    grid = (triton.cdiv(num_pairs, block),)
    _count_kernel[grid](ids, counts, num_pairs, first_expert, num_experts,
                        BLOCK=block, BINS=triton.next_power_of_2(num_experts + 1))
    bins = triton.next_power_of_2(num_experts)
    _offsets_kernel[(1,)](counts, cursor, block_expert, pair_ids, num_experts, num_pairs, num_blocks, max_pairs,
                          BLOCK_M=block_m, BINS=bins, ROWS=max(16, 4096 // bins), FILL=1024)
    _scatter_kernel[grid](ids, cursor, pair_ids, num_pairs, first_expert, num_experts, BLOCK=block)
    return pair_ids, block_expert
