"""fp8_w8a8 (e4m3 x with per-token scales times e4m3 weights with per-channel or 128 x 128
block scales, plus a bias) against the float64 product of the dequantized operands: every
bucket's tile (swapped and not), split-K, masked rows, columns and K, a partial scale block;
float16 and float32 out in the interpreter, bfloat16 at the 8B shapes on the GPU."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.fp8_w8a8 import (
    CANDIDATES,
    FP8,
    SCALE_BLOCK,
    TILES,
    Tile,
    fp8_w8a8,
    split_k,
    tile_for,
    w8a8_linear,
)
from tests.kernels.compiled import HOPPER_SHARED, shared_memory_of

COVERS = ("fp8_w8a8", "w8a8_linear", "tile_for", "split_k")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _operands(m: int, n: int, k: int, blocked: bool, gen: torch.Generator):
    x8 = (torch.randn(m, k, generator=gen) * 100).clamp(-448, 448).to(FP8)
    x_scale = torch.rand(m, 1, generator=gen) * 0.01 + 1e-3
    w = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(FP8)
    shape = (-(-n // SCALE_BLOCK), -(-k // SCALE_BLOCK)) if blocked else (n, 1)
    return x8, x_scale, w, torch.rand(shape, generator=gen) * 0.01 + 1e-3


def _dequantized(w: torch.Tensor, scale: torch.Tensor, blocked: bool) -> torch.Tensor:
    if not blocked:
        return w.double() * scale.double()
    full = scale.double().repeat_interleave(SCALE_BLOCK, 0).repeat_interleave(SCALE_BLOCK, 1)
    return w.double() * full[:w.shape[0], :w.shape[1]]


def _check(m: int, n: int, k: int, dtype: torch.dtype, blocked: bool, with_bias: bool, tile: Tile | None) -> None:
    gen = torch.Generator().manual_seed(m * 31 + n * 7919 + k)
    x8, x_scale, w, scale, bias = (t.to(DEVICE) if t is not None else None for t in (
        *_operands(m, n, k, blocked, gen), torch.randn(n, generator=gen).to(dtype) if with_bias else None))
    out = fp8_w8a8(x8, x_scale, w, scale, bias, out_dtype=dtype, blocked=blocked, tile=tile)
    assert out.shape == (m, n) and out.dtype == dtype
    # The float64 reference where the operands are (on the GPU at the 8B shapes: seconds, not minutes).
    xd, wd = x8.double() * x_scale.double(), _dequantized(w, scale, blocked)
    ref = xd @ wd.T + (bias.double() if bias is not None else 0)
    # Products of e4m3 numbers are exact in float32 (8 significant bits); a float32 sum over k
    # of them, a few float32 scalings, one rounding to the dtype. On the GPU each K tile's sum
    # is the FP8 tensor cores' own, in fewer bits (about 14: DeepSeek-V3's report, 3.3.2; the
    # whole K with fast accumulation, at most a few dozen wgmma steps in these tests): 2**-10.
    size = (xd.abs() @ wd.abs().T).max().item()
    tensor_cores = 2.0 ** -10 if DEVICE == "cuda" else 0.0
    atol = size * ((k + 4) * torch.finfo(torch.float32).eps + torch.finfo(dtype).eps + tensor_cores)
    torch.testing.assert_close(out.double(), ref, rtol=torch.finfo(dtype).eps, atol=atol)


SMALL = [Tile(16, 64, 64, swap=True), Tile(32, 64, 32, swap=True, split_k=3),
         Tile(16, 16, 64, swap=False), Tile(32, 32, 32, swap=False, split_k=2)]


@pytest.mark.parametrize("tile", SMALL, ids=Tile.describe)
@pytest.mark.parametrize("m, n, k", [(1, 64, 128), (3, 50, 200), (20, 72, 130)])
@pytest.mark.parametrize("blocked", [False, True])
def test_fp8_w8a8_matches_the_dequantized_product(tile, m, n, k, blocked):
    _check(m, n, k, torch.float16, blocked, with_bias=m % 2 == 1, tile=tile)


def test_fp8_w8a8_float32_out_bias_and_split_k_by_rule():
    """5 x 136 x 1,100: the rule splits a lone column tile's K; bias added once, after the sum."""
    tile = Tile(16, 128, 32, swap=True)
    assert split_k(2, 1100, 32) > 1
    _check(5, 136, 1100, torch.float32, blocked=False, with_bias=True, tile=tile)


def test_fp8_w8a8_fast_accumulation_per_channel():
    _check(4, 64, 96, torch.float32, blocked=False, with_bias=False, tile=Tile(16, 64, 32, swap=True, fast_acc=True))


def test_w8a8_linear_quantizes_x_per_token():
    """x in float32: quantized by fp8_quant, then the product; against x's own product within
    e4m3's rounding of x (2**-4 relative a value)."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(6, 96, generator=gen)
    _, _, w, scale = _operands(6, 40, 96, False, gen)
    out = w8a8_linear(x.to(DEVICE), w.to(DEVICE), scale.to(DEVICE), tile=Tile(16, 64, 32, swap=True)).cpu()
    wd = _dequantized(w, scale, False)
    atol = (x.double().abs() @ wd.abs().T).max().item() * 2.0 ** -4
    torch.testing.assert_close(out.double(), x.double() @ wd.T, rtol=0, atol=atol)
    assert out.dtype == torch.float32


def test_the_table_covers_every_row_count_and_refuses_beyond():
    assert [tile_for(m) for m in (1, 16)] == [TILES[0][1]] * 2
    assert tile_for(17) is TILES[1][1] and tile_for(512) is TILES[-1][1]
    with pytest.raises(ValueError, match="at most 512 rows"):
        tile_for(513)


def test_bad_arguments_are_refused_by_name():
    x8, x_scale, w, scale = _operands(2, 64, 64, False, torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="weight scale"):
        fp8_w8a8(x8, x_scale, w, scale.double())
    with pytest.raises(ValueError, match="x_scale"):
        fp8_w8a8(x8, x_scale.T.contiguous(), w, scale)
    with pytest.raises(ValueError, match="e4m3"):
        fp8_w8a8(x8.float(), x_scale, w, scale)
    with pytest.raises(ValueError, match="BLOCK_K must divide"):
        fp8_w8a8(x8, x_scale, w, torch.ones(1, 1), blocked=True, tile=Tile(16, 64, 256, swap=True))
    with pytest.raises(ValueError, match="block_m"):
        Tile(24, 64, 64, swap=True)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 16, 32, 64, 128, 256, 512])
@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
@pytest.mark.parametrize("blocked", [False, True])
def test_fp8_w8a8_at_the_8b_shapes(m, n, k, blocked):
    _check(m, n, k, torch.bfloat16, blocked, with_bias=m == 2, tile=None)


def test_every_tile_compiles_for_hopper_to_e4m3_wgmma_within_shared_memory_and_registers():
    """The table's and the sweep's tiles compiled for sm_90 by Triton (its own ptxas; no GPU):
    each dot an e4m3 x e4m3 wgmma with the tile's N (BLOCK_M swapped, else BLOCK_N, at most
    256), shared memory within an H100's, no register spills."""
    rows = shared_memory_of("fp8_w8a8", details=True)
    gemms = [r for r in rows if r["kernel"] == "_w8a8_kernel"]
    assert len({r["case"] for r in gemms}) == len(gemms) > 2 * sum(map(len, CANDIDATES.values())), len(gemms)
    assert {r["kernel"] for r in rows} == {"_w8a8_kernel", "_sum_splits_kernel"}
    for r in rows:
        assert r["shared"] <= HOPPER_SHARED and r["spill_bytes"] == 0, r
    for r in gemms:
        assert len(r["mma"]) == 1 and r["mma"][0].startswith("wgmma.mma_async.sync.aligned.m64n"), r
        assert r["mma"][0].endswith("k32.f32.e4m3.e4m3"), r


@pytest.mark.gpu
@pytest.mark.parametrize("m", [8, 300])
def test_the_dispatch_option_takes_w8a8_and_agrees_with_the_scaled_matmul(m):
    """`fp8.linear(..., w8a8=True)`, the benchmark's option: the same x quantization as the
    scaled-matmul path, so the two differ by float32 summation order and one bf16 rounding."""
    from pdserve.engine.models import fp8

    gen = torch.Generator().manual_seed(m)
    w8, scale = fp8.quantize_per_channel(torch.randn(6144, 4096, generator=gen) * 0.02)
    x = torch.randn(m, 4096, generator=gen).to(DEVICE, torch.bfloat16)
    w8, scale = w8.to(DEVICE), scale.float().to(DEVICE)
    ours, theirs = fp8.linear(x, w8, scale, None, False, w8a8=True), fp8.linear(x, w8, scale, None, False)
    assert ours.dtype == torch.bfloat16 and ours.shape == (m, 6144)
    atol = theirs.float().abs().max().item() * 2 ** -8
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=2 ** -7, atol=atol)
