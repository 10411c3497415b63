"""Fused Mixture-of-Experts: each token's top-k experts' SwiGLU MLPs, summed with the
router's weights, as two grouped GEMMs (vLLM's and SGLang's fused_moe, simpler).

The (token, slot) pairs are sorted by expert and each expert's run padded to a multiple
of BLOCK_M (`_align`, plain torch without a host sync: every size is fixed by the token
count, so a CUDA graph can hold it). A program of the first kernel takes BLOCK_M pairs of
one expert and BLOCK_N columns of its gate and of its up projection, accumulates both
over the hidden dimension and stores silu(gate) * up: the gate/up GEMM and SwiGLU's
activation in one kernel. The second multiplies that by the expert's down projection and
the pair's routing weight; the k slots of a token are summed last.

Experts outside this rank's (expert parallelism: ids first_expert .. first_expert + E - 1
are here) contribute nothing; blocks past the padded runs exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gate_up_silu_kernel(
    x_ptr,            # [T, H]: the tokens
    w13_ptr,          # [E, 2I, H]: each expert's gate rows, then its up rows
    out_ptr,          # [T * k, I]: silu(gate) * up of every (token, slot) pair
    pair_ids_ptr,     # [M_max] int32: pairs sorted by expert, each run padded with T * k
    block_expert_ptr,  # [M_max / BLOCK_M] int32: the expert of each block of pairs, -1 past the last
    num_pairs, top_k, hidden, inter,
    stride_xt, stride_we, stride_wn, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
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
        acc_gate = tl.dot(a, gate, acc_gate)
        acc_up = tl.dot(a, up, acc_up)
    act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    out = out_ptr + pairs.to(tl.int64)[:, None] * stride_ot + cols[None, :]
    tl.store(out, act.to(out_ptr.dtype.element_ty), mask=pair_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(
    act_ptr,          # [T * k, I]
    w2_ptr,           # [E, H, I]
    weights_ptr,      # [T * k] float32: each pair's routing weight
    out_ptr,          # [T * k, H]: weight x down(act) of every pair of this rank's experts
    pair_ids_ptr, block_expert_ptr,
    num_pairs, hidden, inter,
    stride_at, stride_we, stride_wn, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
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
        acc = tl.dot(a, b, acc)
    weight = tl.load(weights_ptr + rows, mask=pair_ok, other=0.0)
    out = out_ptr + rows[:, None] * stride_ot + cols[None, :]
    tl.store(out, (acc * weight[:, None]).to(out_ptr.dtype.element_ty), mask=pair_ok[:, None] & col_ok[None, :])


def _align(ids: torch.Tensor, num_experts: int, first_expert: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair ids sorted by local expert, each expert's run padded to BLOCK_M with T*k;
    the expert of each block, -1 past the runs). Sizes depend on T*k and E only."""
    num_pairs = ids.numel()
    local = ids.flatten() - first_expert
    local = torch.where((local >= 0) & (local < num_experts), local, num_experts)  # others: a bucket of their own
    counts = torch.bincount(local, minlength=num_experts + 1)[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    order = torch.argsort(local, stable=True)
    sorted_experts = local[order]
    starts = torch.cumsum(counts, 0) - counts  # each expert's first position in `order`
    mine = sorted_experts < num_experts
    expert_of = sorted_experts.clamp(max=num_experts - 1)
    rank = torch.arange(num_pairs, device=ids.device) - starts[expert_of]
    dest = torch.where(mine, padded_start[expert_of] + rank, 0)
    max_pairs = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m
    pair_ids = torch.full((max_pairs + 1,), num_pairs, dtype=torch.int32, device=ids.device)
    pair_ids.scatter_(0, torch.where(mine, dest, max_pairs), order.to(torch.int32))  # others land on the spare slot
    block_starts = torch.arange(0, max_pairs, block_m, device=ids.device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return pair_ids[:max_pairs], block_expert


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
              first_expert: int = 0, block_m: int = 16, block_n: int = 64, block_k: int = 32) -> torch.Tensor:
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
        block_m, block_n, block_k: the tile (powers of two, >= 16).

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
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"fused_moe: weights must be x's dtype {x.dtype}, got {w13.dtype} and {w2.dtype}")
    if ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != num_tokens:
        raise ValueError(f"fused_moe: ids and weights must both be [{num_tokens}, k], got {tuple(ids.shape)} "
                         f"and {tuple(weights.shape)}")
    for name, block in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if block < 16 or block & (block - 1):
            raise ValueError(f"fused_moe: {name} must be a power of two >= 16, got {block}")
    top_k = ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros((num_tokens, hidden), dtype=x.dtype, device=x.device)
    pair_ids, block_expert = _align(ids, num_experts, first_expert, block_m)
    act = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    num_blocks = block_expert.shape[0]
    _gate_up_silu_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        x, w13, act, pair_ids, block_expert, num_pairs, top_k, hidden, inter,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    per_pair = torch.zeros((num_pairs, hidden), dtype=x.dtype, device=x.device)
    _down_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        act, w2, weights.reshape(-1).to(torch.float32), per_pair, pair_ids, block_expert, num_pairs, hidden, inter,
        act.stride(0), w2.stride(0), w2.stride(1), per_pair.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return torch.sum(per_pair.view(num_tokens, top_k, hidden), dim=1)
