"""y = x @ W.T (+ b) for one row of x: the linear layers of a batch-1 decode step.

At one row a linear layer is a pure weight read, and cuBLAS's kernels for that shape
leave bandwidth behind on the mid-sized projections of a Llama layer (measured on the
H200, CUDA graphs, back to back, cold weights: 4096 x 4096 at 2.70 TB/s, 6144 x 4096 at
3.35 TB/s). Each program here owns BLOCK_N output rows and walks all of K in BLOCK_K
steps, accumulating in float32 elementwise and reducing once at the end: no split-K
partials, no second kernel, one launch per layer. 3.25 and 3.76 TB/s on the same shapes.
Launched with programmatic dependent launch (`_pdl`); with `read_ahead` each program reads
its first weight tile while the kernel before it is still finishing.

FP8 weights (float8_e4m3fn, half the bytes of bf16: a batch-1 decode step's whole cost) run
the same kernel: each tile is widened to float32 as every tile is, and the scales are
applied in float32, per output row once at the end, or per 128 x 128 block on each tile
(`blocked`: the tile's scales gathered from the few blocks it covers, cached).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels import _pdl


@triton.jit
def _weights(row_ptrs, rows, k0, N, K: tl.constexpr, EVEN: tl.constexpr, BLOCK_K: tl.constexpr):
    """The weight tile [BLOCK_N, BLOCK_K] at column k0."""
    cols = k0 + tl.arange(0, BLOCK_K)
    if EVEN:
        return tl.load(row_ptrs + cols[None, :], eviction_policy="evict_first")
    return tl.load(row_ptrs + cols[None, :], mask=(rows[:, None] < N) & (cols[None, :] < K), other=0.0,
                   eviction_policy="evict_first")


@triton.jit
def _x(x_ptr, k0, K: tl.constexpr, EVEN: tl.constexpr, BLOCK_K: tl.constexpr):
    """x's slice [BLOCK_K] at column k0, in float32."""
    cols = k0 + tl.arange(0, BLOCK_K)
    if EVEN:
        return tl.load(x_ptr + cols).to(tl.float32)
    return tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)


@triton.jit
def _widened(w, s_ptr, rows, k0, N, stride_sn, BLOCKED: tl.constexpr, BLOCK_K: tl.constexpr):
    """A weight tile in float32, times its 128 x 128 block scales when BLOCKED."""
    if BLOCKED:
        cols = k0 + tl.arange(0, BLOCK_K)
        scales = tl.load(s_ptr + (rows // 128)[:, None] * stride_sn + (cols // 128)[None, :],
                         mask=rows[:, None] < N, other=0.0)
        return w.to(tl.float32) * scales
    else:
        return w.to(tl.float32)


@triton.jit
def _gemv_kernel(
    x_ptr,      # [K], contiguous
    w_ptr,      # [N, K], rows contiguous (stride_wn apart)
    s_ptr,      # FP8 weights' float32 scales: [N, 1], or [ceil(N/128), ceil(K/128)] when BLOCKED; a dummy when not
    b_ptr,      # [N] or a dummy when not HAS_BIAS
    y_ptr,      # [N], contiguous
    N, stride_wn, stride_sn, K: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN: tl.constexpr, SCALED: tl.constexpr, BLOCKED: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr, READ_AHEAD: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    if READ_AHEAD:  # the weights are final: the first tile is read while the kernel before finishes
        w = _weights(row_ptrs, rows, 0, N, K, EVEN, BLOCK_K)
        _pdl.wait(PDL)
    else:
        _pdl.wait(PDL)
        w = _weights(row_ptrs, rows, 0, N, K, EVEN, BLOCK_K)
    acc = _widened(w, s_ptr, rows, 0, N, stride_sn, BLOCKED, BLOCK_K) * _x(x_ptr, 0, K, EVEN, BLOCK_K)[None, :]
    for k0 in tl.range(BLOCK_K, K, BLOCK_K):
        w = _weights(row_ptrs, rows, k0, N, K, EVEN, BLOCK_K)
        acc += _widened(w, s_ptr, rows, k0, N, stride_sn, BLOCKED, BLOCK_K) * _x(x_ptr, k0, K, EVEN, BLOCK_K)[None, :]
    y = tl.sum(acc, axis=1)
    if SCALED and not BLOCKED:
        y *= tl.load(s_ptr + rows * stride_sn, mask=rows < N, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < N)


# (N, K) -> (BLOCK_N, BLOCK_K, num_warps) where a sweep on the H200 (cold weights, CUDA
# graphs; benchmarks/RESULTS.md, "A GEMV for one row" and "The draft's GEMVs") beat the rules
# below: the 1B draft's projections and lm_head, the 8B's o_proj.
_TUNED: dict[tuple[int, int], tuple[int, int, int]] = {
    (3072, 2048): (4, 512, 4),
    (2048, 2048): (4, 512, 8),
    (16384, 2048): (4, 1024, 8),
    (2048, 8192): (4, 1024, 4),
    (128256, 2048): (8, 1024, 4),
    (4096, 4096): (8, 1024, 4),
    # DeepSeek-V2-Lite's (`benchmarks/gemv_sweep.py --v2-lite`, an H100, 2026-12-06): kv_a_proj,
    # the router, the shared experts, the dense layer, lm_head. Its q_proj (3072, 2048) and
    # o_proj (2048, 2048) kept the entries above.
    (576, 2048): (4, 1024, 8),
    (64, 2048): (4, 1024, 4),
    (5632, 2048): (8, 1024, 4),
    (2048, 2816): (8, 1024, 8),
    (21888, 2048): (4, 1024, 4),
    (2048, 10944): (8, 1024, 8),
    (102400, 2048): (4, 512, 4),
}


def _config(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps): the sweep's choice for a shape it timed, else rules from
    the sweep of the 8B's projections (benchmarks/RESULTS.md, "A GEMV for one row")."""
    if (n, k) in _TUNED:
        return _TUNED[n, k]
    if k >= 8192:
        return 8, 512, 8
    if n >= 16384 and n < 65536:
        return 16, 256, 4
    return 8, 256, 4


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         read_ahead: bool = False, scale: torch.Tensor | None = None, blocked: bool = False,
         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [1, K] @ weight.T [K, N] (+ bias [N]) -> [1, N] in out_dtype (default x's);
    accumulates in float32, x and the weight widened to it as read (a float32 weight beside a
    bfloat16 x: x.float() @ weight.T without the copy).

    read_ahead: the weights were final before the kernel preceding this one started (a
    model's, once loaded): read their first tile before waiting for it (`kernels._pdl`).
    scale: FP8 weights' (float8_e4m3fn) float32 scales, w = weight * scale: [N, 1] per output
    row, or with `blocked` [ceil(N/128), ceil(K/128)] per 128 x 128 block.

    x's last dim and weight's rows contiguous; one launch, no host sync: safe to capture in
    a CUDA graph.
    """
    n, k = weight.shape
    assert x.shape == (1, k) and x.stride(-1) == 1 and weight.stride(1) == 1, (x.shape, weight.shape)
    if scale is not None:
        want = (triton.cdiv(n, 128), triton.cdiv(k, 128)) if blocked else (n, 1)
        assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32, (weight.dtype, scale.dtype)
        assert tuple(scale.shape) == want and scale.stride(1) == 1, (scale.shape, want)
    y = torch.empty((1, n), dtype=out_dtype or x.dtype, device=x.device)
    block_n, block_k, num_warps = _config(n, k)
    even = n % block_n == 0 and k % block_k == 0
    pdl = _pdl.pdl(x)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, scale if scale is not None else y, bias if bias is not None else y, y, n, weight.stride(0),
        scale.stride(0) if scale is not None else 0, k,
        HAS_BIAS=bias is not None, EVEN=even, SCALED=scale is not None, BLOCKED=scale is not None and blocked,
        BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl, READ_AHEAD=read_ahead, num_warps=num_warps, launch_pdl=pdl)
    return y
