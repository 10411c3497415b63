"""The Gluon kernel behind kernels.skinny_gemm (which checks arguments and falls back
cleanly where Gluon, an experimental Triton dialect, is missing or has changed):
y[M, N] = x[M, K] @ W[N, K].T (+ b) for a few rows of x (M <= ROWS = 8), on the tensor
cores with mma.sync (m16n8k16).

The product is computed transposed, y.T = W @ x.T, so the weights are the MMA's 16-row A
operand and x's rows its narrow B operand (one instruction's 8 columns, padded). Each thread
loads its A fragments straight from global memory (k_width 8: eight consecutive K
elements a thread, one 16-byte load), so the weights never pass through shared memory;
x's slices come from L1/L2. A program owns BLOCK_N rows of W and its S x WN warps split
the work as a batch dimension of the MMA: warp (s, r) walks K segment s (K / S columns)
of rows r * 16 ...; the S partial sums are added in a fixed order at the end (the
compiler's cross-warp reduction through shared memory). So there is no split-K second
kernel, every row of x rounds exactly as it would alone, and each SM keeps enough weight
loads in flight: a 4096 x 4096 layer is 256 programs of 4 warps.

Each warp double-buffers: it issues the next tile's loads before multiplying the current
one. With PDL the first weight tile is read before the wait (the weights are final).
"""

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

# x's rows, padded to the MMA's 8 columns. Two instructions' 16 lost to cuBLAS on the H200
# (the 8B's decode step at batch 16 5.12 -> 5.54 ms), likely because every program reads
# all of x from L2, which at 16 rows is as many bytes as the weights (not measured).
ROWS = gl.constexpr(8)


@gluon.jit
def _pdl_wait(PDL: gl.constexpr):
    """kernels._pdl.wait, in Gluon: wait for the previous kernel, then let the next launch."""
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)


@gluon.jit
def _skinny_gemm_kernel(
    x_ptr,      # [M, K], rows stride_xm apart, columns contiguous
    w_ptr,      # [N, K], rows stride_wn apart, columns contiguous
    b_ptr,      # [N] or a dummy when not HAS_BIAS
    y_ptr,      # [M, N], rows stride_ym apart
    M, stride_xm, stride_wn, stride_ym, K: gl.constexpr,
    BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, S: gl.constexpr, WN: gl.constexpr,
    HAS_BIAS: gl.constexpr, PDL: gl.constexpr, READ_AHEAD: gl.constexpr,
):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[S, WN, 1], instr_shape=[1, 16, 8])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
    SEGMENT: gl.constexpr = K // S
    row0 = gl.program_id(0) * BLOCK_N

    # W tile [S, BLOCK_N, BLOCK_K]: segment s, row n, column k -> W[row0 + n, s * SEGMENT + k]
    a_s = gl.arange(0, S, layout=gl.SliceLayout(1, gl.SliceLayout(2, a_layout)))
    a_n = row0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(2, a_layout)))
    a_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, gl.SliceLayout(1, a_layout)))
    w_ptrs = w_ptr + a_n.to(gl.int64)[None, :, None] * stride_wn + (a_s * SEGMENT)[:, None, None] + a_k[None, None, :]
    # x.T tile [S, BLOCK_K, ROWS]: segment s, column k, row m -> x[m, s * SEGMENT + k], rows >= M zero
    b_s = gl.arange(0, S, layout=gl.SliceLayout(1, gl.SliceLayout(2, b_layout)))
    b_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, gl.SliceLayout(2, b_layout)))
    b_m = gl.arange(0, ROWS, layout=gl.SliceLayout(0, gl.SliceLayout(1, b_layout)))
    x_ptrs = x_ptr + (b_s * SEGMENT)[:, None, None] + b_k[None, :, None] + b_m[None, None, :] * stride_xm
    # rows >= M read as zero; the other two terms are always true and broadcast the mask to the tile
    x_mask = (b_s[:, None, None] < S) & (b_k[None, :, None] < BLOCK_K) & (b_m[None, None, :] < M)

    if READ_AHEAD:  # the weights are final: the first tile is read while the kernel before finishes
        w = gl.load(w_ptrs, eviction_policy="evict_first")
        _pdl_wait(PDL)
    else:
        _pdl_wait(PDL)
        w = gl.load(w_ptrs, eviction_policy="evict_first")
    xt = gl.load(x_ptrs, mask=x_mask, other=0.0)
    acc = gl.zeros([S, BLOCK_N, ROWS], gl.float32, mma)
    for k0 in range(BLOCK_K, SEGMENT, BLOCK_K):
        w_next = gl.load(w_ptrs + k0, eviction_policy="evict_first")
        x_next = gl.load(x_ptrs + k0, mask=x_mask, other=0.0)
        acc = mma_v2(w, xt, acc)
        w = w_next
        xt = x_next
    acc = mma_v2(w, xt, acc)

    y = gl.sum(acc, axis=0)  # [BLOCK_N, ROWS]: the segments, in a fixed order
    y_layout: gl.constexpr = y.type.layout
    o_n = row0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, y_layout))
    o_m = gl.arange(0, ROWS, layout=gl.SliceLayout(0, y_layout))
    if HAS_BIAS:
        y += gl.load(b_ptr + o_n).to(gl.float32)[:, None]
    y_ptrs = y_ptr + o_m[None, :] * stride_ym + o_n[:, None]
    # rows >= M not stored (o_n >= 0, always true, broadcasts the mask to the tile)
    gl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=(o_n[:, None] >= 0) & (o_m[None, :] < M))


def launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, block_n: int,
           block_k: int, splits: int, row_warps: int, pdl: bool, read_ahead: bool) -> None:
    m, k = x.shape
    _skinny_gemm_kernel[(triton.cdiv(weight.shape[0], block_n),)](
        x, weight, bias if bias is not None else y, y, m, x.stride(0), weight.stride(0), y.stride(0), k,
        BLOCK_N=block_n, BLOCK_K=block_k, S=splits, WN=row_warps, HAS_BIAS=bias is not None,
        PDL=pdl, READ_AHEAD=read_ahead, num_warps=splits * row_warps, launch_pdl=pdl)
