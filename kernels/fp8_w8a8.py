"""y = (x8 * x_scale) @ (w8 * w_scale).T (+ b): FP8 e4m3 activations (per-token scales,
`kernels.fp8_quant`) times FP8 e4m3 weights (per output channel, or per 128 x 128 block),
on the FP8 tensor cores, for the linear layers of an FP8 model at 2-512 rows (issue 53).

cuBLASLt's scaled matmul took 2.2x the weight read at 1-256 rows on an H100 (RESULTS "FP8
weights on the H100"): its tiles are made for large M. Here every tile streams the weight
once and is chosen per bucket of M (`TILES`):
- swap-AB (M <= 128): the product is computed as W x^T, so the weight's N rows fill the
  MMA's M side (wgmma's M is 64 a warpgroup) and the few token rows become its N (16-128);
  the accumulator is [BLOCK_N, BLOCK_M], stored transposed;
- split-K (`split_k`) where the weight's column tiles alone are fewer than the SMs: each
  split writes its float32 partial and one small kernel sums them in a fixed order;
- both operands are loaded K-major (e4m3 wgmma takes no transposed operand).

Scales are applied to products, never to operands: the weight's per-channel scale and x's
per-token scale once on the finished float32 accumulator ((acc * w_scale) * x_scale); a block
scale on each K tile's partial product (BLOCK_K divides 128). Each K tile's dot starts from
zero and is added to the float32 accumulator: on sm_90 an FP8 dot's accumulator is the tensor
cores' reduced-precision one (Triton's max_num_imprecise_acc default), so this promotes it to
float32 every BLOCK_K products, as cuBLASLt without fast accumulation does (`FAST_ACC`
accumulates the whole K in the tensor cores instead, a sweep candidate only).
Never run on a GPU yet: `engine.models.fp8.linear(..., w8a8=True)` is opt-in, for
`benchmarks/fp8_linear.py --sweep`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdserve.kernels.fp8_quant import quantize_per_token

FP8 = torch.float8_e4m3fn
SCALE_BLOCK = 128
MAX_ROWS = 512  # beyond: cuBLASLt's scaled matmul (compute-bound, its large tiles win)
HOPPER_SMS = 132  # an H100 SXM's (an H200's too): the split-K rule's target


@dataclass(frozen=True, slots=True)
class Tile:
    """One launch configuration: a program computes rows [BLOCK_M] x columns [BLOCK_N] of y
    over K in BLOCK_K steps; swap: W x^T (weight rows on the MMA's M side); split_k: None for
    the rule (`split_k`), else that many K splits."""

    block_m: int
    block_n: int
    block_k: int
    swap: bool
    num_warps: int = 4
    num_stages: int = 4
    split_k: int | None = None
    fast_acc: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"Tile.{name} must be a power of two >= 16, got {value}")
        if self.block_k < 32:
            raise ValueError(f"Tile.block_k must be >= 32 (an e4m3 dot's least K), got {self.block_k}")
        if self.split_k is not None and self.split_k < 1:
            raise ValueError(f"Tile.split_k must be >= 1 or None, got {self.split_k}")

    def describe(self) -> str:
        split = "auto" if self.split_k is None else self.split_k
        return (f"{'swap ' if self.swap else ''}{self.block_m}x{self.block_n}x{self.block_k} "
                f"w{self.num_warps} s{self.num_stages} k{split}{' fast' if self.fast_acc else ''}")


# Per bucket of M (its largest M): bytes a program keeps in flight = stages x (BLOCK_N +
# BLOCK_M) x BLOCK_K; an H100 streams ~3 TB/s at ~1-2 us of latency, so ~3-6 MB must be in
# flight chip-wide: >= 64 programs x 48-96 KB. Shared memory: at most 232,448 bytes a program.
# - <= 16: swap, wgmma 64 x 16 x 32; 4 stages x (64 + 16) x 128 = 40 KB, up to 5 programs an SM;
#   split-K brings 64 column tiles (N = 4096) to >= 132 programs.
# - <= 32 / <= 64: the same with wgmma N = 32 / 64 (48 / 64 KB).
# - <= 128: swap, wgmma m64n128: the weight read once, 4 stages x 192 x 128 = 96 KB, 2 programs an SM.
# - <= 256: not swapped, 128 rows x 64 columns (one warpgroup, two m64n64 wgmmas a K step): at
#   256 rows compute (0.078 ms at 2x the measured bf16 rate) meets the read (0.073), so every
#   SM needs a program: 64 column tiles x 2 row tiles = 128 at N = 4096 (128 x 128 would give 64);
#   the weight is read twice, the second time mostly from L2 (a column's row tiles run together).
# - <= 512: 128 x 128, 8 warps (two warpgroups of m64n128), 128 programs at N = 4096, compute-
#   bound (0.156 ms); 128 x 256 would halve x's re-reads but needs a second 128-register
#   accumulator for the promotion and spills (ptxas: ~500 bytes), so it is a candidate only
#   with fast accumulation (one accumulator).
# From 129 rows no split-K: its float32 partials would cost more than the programs it adds.
TILES: tuple[tuple[int, Tile], ...] = (
    (16, Tile(16, 64, 128, swap=True)),
    (32, Tile(32, 64, 128, swap=True)),
    (64, Tile(64, 64, 128, swap=True)),
    (128, Tile(128, 64, 128, swap=True)),
    (256, Tile(128, 64, 128, swap=False, split_k=1)),
    (512, Tile(128, 128, 128, swap=False, num_warps=8, split_k=1)),
)
# The sweep's candidates per bucket (benchmarks/fp8_linear.py --sweep), the table's first:
# deeper pipelines, wider K steps, split-K off, taller weight tiles, swapped or not near the
# crossover, more rows a tile at 256-512, and fast accumulation where compute binds.
CANDIDATES: dict[int, tuple[Tile, ...]] = {
    16: (TILES[0][1], Tile(16, 64, 128, swap=True, split_k=1), Tile(16, 64, 256, swap=True),
         Tile(16, 64, 128, swap=True, num_stages=6), Tile(16, 128, 128, swap=True)),
    32: (TILES[1][1], Tile(32, 64, 256, swap=True), Tile(32, 64, 128, swap=True, num_stages=6),
         Tile(32, 64, 128, swap=True, split_k=1)),
    64: (TILES[2][1], Tile(64, 64, 256, swap=True), Tile(64, 128, 128, swap=True, num_warps=8),
         Tile(64, 64, 128, swap=False)),
    128: (TILES[3][1], Tile(128, 64, 128, swap=False), Tile(128, 128, 128, swap=False, num_warps=8),
          Tile(128, 64, 128, swap=True, num_stages=3)),
    256: (TILES[4][1], Tile(256, 64, 128, swap=False, num_warps=8, split_k=1),
          Tile(128, 128, 128, swap=False, num_warps=8, split_k=1), Tile(128, 128, 128, swap=False, num_warps=8)),
    512: (TILES[5][1], Tile(128, 128, 128, swap=False, num_warps=8, num_stages=3, split_k=1),
          Tile(128, 128, 128, swap=False, num_warps=8, split_k=1, fast_acc=True),
          Tile(128, 256, 128, swap=False, num_warps=8, num_stages=3, split_k=1, fast_acc=True)),
}


def tile_for(m: int) -> Tile:
    """The table's tile for M rows (1 <= M <= MAX_ROWS)."""
    for upper, tile in TILES:
        if m <= upper:
            return tile
    raise ValueError(f"fp8_w8a8 takes at most {MAX_ROWS} rows, got {m}: use the scaled matmul")


def split_k(programs: int, k: int, block_k: int, sms: int = HOPPER_SMS) -> int:
    """K splits so that programs x splits >= sms, each split keeping >= 8 K steps (a
    pipeline of 4 stages fills in 3 and the splits' partials stay small)."""
    splits = 1
    while programs * splits < sms and k // (block_k * splits * 2) >= 8:
        splits *= 2
    return splits


@triton.jit
def _w8a8_kernel(
    x_ptr, xs_ptr,   # [M, K] e4m3, rows stride_xm apart; [M, 1] float32
    w_ptr, ws_ptr,   # [N, K] e4m3, rows stride_wn apart; [N, 1] or [ceil(N/128), ceil(K/128)] float32
    b_ptr, y_ptr,    # [N] (or a dummy); y [SPLITS, M, N] (float32 partials) or [M, N], rows stride_ym apart
    M, N, K, K_SPLIT, stride_xm, stride_wn, stride_sn, stride_ym, stride_ys,
    HAS_BIAS: tl.constexpr, BLOCKED: tl.constexpr, SWAP: tl.constexpr, FAST_ACC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_begin = tl.program_id(2) * K_SPLIT
    k_end = tl.minimum(K, k_begin + K_SPLIT)
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm   # x's tile [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_wn   # W's tile [BLOCK_N, BLOCK_K]
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptrs + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < k_end), other=0.0)
        w = tl.load(w_ptrs + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < k_end), other=0.0,
                    eviction_policy="evict_first")
        if FAST_ACC:  # the whole K in the tensor cores' accumulator (per channel only)
            if SWAP:
                acc = tl.dot(w, tl.trans(x), acc)
            else:
                acc = tl.dot(x, tl.trans(w), acc)
        else:
            if SWAP:
                part = tl.dot(w, tl.trans(x))
            else:
                part = tl.dot(x, tl.trans(w))
            if BLOCKED:
                s = tl.load(ws_ptr + (cols // 128) * stride_sn + k0 // 128, mask=cols < N, other=0.0)
                if SWAP:
                    acc += part * s[:, None]
                else:
                    acc += part * s[None, :]
            else:
                acc += part
    xs = tl.load(xs_ptr + rows, mask=rows < M, other=0.0)
    if SWAP:
        if not BLOCKED:
            acc *= tl.load(ws_ptr + cols * stride_sn, mask=cols < N, other=0.0)[:, None]
        acc *= xs[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[:, None]
        y_ptrs = y_ptr + tl.program_id(2) * stride_ys + rows.to(tl.int64)[None, :] * stride_ym + cols[:, None]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(rows[None, :] < M) & (cols[:, None] < N))
    else:
        if not BLOCKED:
            acc *= tl.load(ws_ptr + cols * stride_sn, mask=cols < N, other=0.0)[None, :]
        acc *= xs[:, None]
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + tl.program_id(2) * stride_ys + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _sum_splits_kernel(p_ptr, b_ptr, y_ptr, MN, N, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK: tl.constexpr):
    """y = sum of the SPLITS float32 partials [SPLITS, M*N], in order, (+ bias), in y's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.load(p_ptr + offs, mask=offs < MN, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(p_ptr + s * MN + offs, mask=offs < MN, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=offs < MN, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=offs < MN)


def fp8_w8a8(x8: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
             bias: torch.Tensor | None = None, *, out_dtype: torch.dtype = torch.bfloat16, blocked: bool = False,
             tile: Tile | None = None) -> torch.Tensor:
    """x8 [M, K] e4m3 with x_scale [M, 1] float32 (`quantize_per_token`) times (weight [N, K]
    e4m3, scale [N, 1] or with `blocked` [ceil(N/128), ceil(K/128)] float32).T (+ bias [N])
    -> [M, N] out_dtype; float32 accumulation. tile: `tile_for(M)` unless given (the sweep's).
    No host sync: one launch (two with split-K), safe to capture in a CUDA graph."""
    m, k = x8.shape
    n = weight.shape[0]
    if x8.dtype != FP8 or x8.stride(1) != 1 or weight.dtype != FP8 or weight.shape != (n, k) or weight.stride(1) != 1:
        raise ValueError(f"fp8_w8a8 takes e4m3 x [M, K] and weight [N, K] with contiguous rows, got "
                         f"{x8.dtype} {tuple(x8.shape)} and {weight.dtype} {tuple(weight.shape)}")
    want = (triton.cdiv(n, SCALE_BLOCK), triton.cdiv(k, SCALE_BLOCK)) if blocked else (n, 1)
    if scale.dtype != torch.float32 or tuple(scale.shape) != want or scale.stride(1) != 1:
        raise ValueError(f"weight scale must be float32 {want}, got {scale.dtype} {tuple(scale.shape)}")
    if x_scale.dtype != torch.float32 or tuple(x_scale.shape) != (m, 1) or x_scale.stride(0) != 1:
        raise ValueError(f"x_scale must be float32 ({m}, 1), got {x_scale.dtype} {tuple(x_scale.shape)}")
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"bias must be contiguous ({n},), got {tuple(bias.shape)}")
    tile = tile or tile_for(m)
    if blocked and (tile.fast_acc or SCALE_BLOCK % tile.block_k):
        raise ValueError(f"block scales apply per K tile: BLOCK_K must divide {SCALE_BLOCK}, no fast "
                         f"accumulation; got {tile.describe()}")
    y = torch.empty((m, n), dtype=out_dtype, device=x8.device)
    if m == 0:
        return y
    grid_n, grid_m = triton.cdiv(n, tile.block_n), triton.cdiv(m, tile.block_m)
    splits = tile.split_k or split_k(grid_n * grid_m, k, tile.block_k)
    k_split = triton.cdiv(triton.cdiv(k, splits), tile.block_k) * tile.block_k
    splits = triton.cdiv(k, k_split)  # none empty
    out = y if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32, device=x8.device)
    _w8a8_kernel[(grid_n, grid_m, splits)](
        x8, x_scale, weight, scale, bias if bias is not None and splits == 1 else y, out, m, n, k, k_split,
        x8.stride(0), weight.stride(0), scale.stride(0), n, m * n,
        HAS_BIAS=bias is not None and splits == 1, BLOCKED=blocked, SWAP=tile.swap, FAST_ACC=tile.fast_acc,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        num_warps=tile.num_warps, num_stages=tile.num_stages)
    if splits > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](
            out, bias if bias is not None else y, y, m * n, n, SPLITS=splits, HAS_BIAS=bias is not None,
            BLOCK=block, num_warps=4)
    return y


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None, *,
                blocked: bool = False, tile: Tile | None = None) -> torch.Tensor:
    """x [M, K] (float16/bfloat16/float32, contiguous rows) quantized per token, then
    `fp8_w8a8` -> [M, N] in x's dtype."""
    x8, x_scale = quantize_per_token(x)
    return fp8_w8a8(x8, x_scale, weight, scale, bias, out_dtype=x.dtype, blocked=blocked, tile=tile)
