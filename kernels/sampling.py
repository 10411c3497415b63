"""One token per row of logits, drawn at each row's temperature, in one pass (Gumbel-max).

argmax_i(logit_i / T + G_i), G_i = -log(-log(U_i)) with U_i uniform, is a draw from
softmax(logits / T): no softmax, no noise tensor, no second pass over the vocabulary. A
row of temperature 0 takes the argmax (the first one, as torch's). The uniforms come from
Philox (`tl.rand`) keyed by a seed read from the device (so a step's seed can be drawn
there, no host sync) and by each element's (row, column).

At a batch of 256 rows of 128k float32 logits this replaces ~1.4 GB of traffic (argmax,
scale, softmax, an exponential noise tensor, a divide and an argmax again) by one 131 MB
read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _gumbel_argmax_kernel(
    logits_ptr, stride_row,  # [N, V] float32, rows stride_row apart
    temp_ptr,                # [N] float32: <= 0 is greedy
    seed_ptr,                # [1] int64
    out_ptr,                 # [N] int64
    V, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    temperature = tl.load(temp_ptr + row)
    greedy = temperature <= 0.0
    inv_t = tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, temperature))
    seed = tl.load(seed_ptr)
    base = logits_ptr + row.to(tl.int64) * stride_row
    best_val = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int64)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < V
        x = tl.load(base + cols, mask=mask, other=float("-inf"))
        if greedy:
            key = x
        else:
            u = tl.rand(seed, row * V + cols)
            key = x * inv_t - tl.log(-tl.log(u))
            key = tl.where(mask, key, float("-inf"))
        block_max = tl.max(key, axis=0)
        block_idx = tl.argmax(key, axis=0).to(tl.int64) + start
        better = block_max > best_val
        best_idx = tl.where(better, block_idx, best_idx)
        best_val = tl.where(better, block_max, best_val)
    tl.store(out_ptr + row, best_idx)


def gumbel_argmax(logits: torch.Tensor, temperatures: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    """One token id per row of `logits` [N, V] float32 (last dim contiguous): the argmax at
    temperature <= 0, else a draw from softmax(row / temperature). `temperatures` [N]
    float32, `seed` [1] int64 on the same device (a new one per call for independent
    draws). Returns [N] int64. One launch, no host sync."""
    n, v = logits.shape
    assert logits.stride(1) == 1 and logits.dtype == torch.float32, (logits.stride(), logits.dtype)
    assert temperatures.shape == (n,) and seed.numel() == 1, (temperatures.shape, seed.shape)
    assert n * v < 2**31, "Philox offsets are int32"
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n:
        _gumbel_argmax_kernel[(n,)](logits, logits.stride(0), temperatures, seed, out, v, BLOCK=BLOCK,
                                    num_warps=8)
    return out
