"""A Mixture-of-Experts layer's routing on the GPU: the router's top-k (`topk_route`, one
launch for softmax, top-k and renormalization), and the grouped path's layout of the (token,
slot) pairs by expert (`align_by_expert`: a count, the runs' offsets, a scatter). No host sync in either:
every size follows from the token count, so a CUDA graph can hold them. `kernels.fused_moe`
runs the experts over that layout."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels import _pdl


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
    cols = tl.arange(0, BLOCK_E)
    ok = cols < num_experts
    _pdl.wait(PDL)
    logits = tl.load(logits_ptr + token * stride_lt + cols, mask=ok, other=float("-inf")).to(tl.float32)
    probs = tl.exp(logits - tl.max(logits, 0))
    probs = tl.where(ok, probs / tl.sum(probs, 0), -1.0)
    slots = tl.arange(0, BLOCK_K)
    chosen = tl.zeros((BLOCK_K,), dtype=tl.float32)
    chosen_ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
    for slot in tl.static_range(TOP_K):
        best = tl.max(probs, 0)
        best_id = tl.min(tl.where(probs == best, cols, BLOCK_E), 0)  # the lowest id among equals, as torch.topk
        chosen = tl.where(slots == slot, best, chosen)
        chosen_ids = tl.where(slots == slot, best_id.to(tl.int64), chosen_ids)
        probs = tl.where(cols == best_id, -1.0, probs)
    if RENORMALIZE:
        chosen = chosen / tl.sum(tl.where(slots < TOP_K, chosen, 0.0), 0)
    tl.store(weights_ptr + token * TOP_K + slots, chosen, mask=slots < TOP_K)
    tl.store(ids_ptr + token * TOP_K + slots, chosen_ids, mask=slots < TOP_K)


def topk_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> (weights [T, k] float32, expert ids [T, k] int64): softmax over every
    expert in float32, the k largest (the lowest id first among equal ones), renormalized to
    sum to 1 when asked. One launch per step, no host sync (the router of a decode step is
    otherwise five small kernels)."""
    num_tokens, num_experts = router_logits.shape
    if router_logits.stride(-1) != 1:
        raise ValueError(f"topk_route: the logits' last dim must be contiguous, got strides {router_logits.stride()}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"topk_route: top_k must be in 1..{num_experts}, got {top_k}")
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=router_logits.device)
    if num_tokens:
        pdl = _pdl.pdl(router_logits)
        _topk_route_kernel[(num_tokens,)](
            router_logits, weights, ids, num_experts, router_logits.stride(0),
            TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_E=triton.next_power_of_2(num_experts),
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
