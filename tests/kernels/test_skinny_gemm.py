"""skinny_gemm (2-8 rows of x times W.T, plus a bias, on the tensor cores) against the
float64 product: 1-8 rows, the tuned shapes of the 8B
target and 1B draft and the rule's (SmolLM2's K = 576 and 1536, a K that splits over
fewer warps), bias or none, fp16 and bf16, strided rows of x and W; every row equal bit
for bit to the same row launched alone. Without a GPU: what it refuses, with a
ValueError naming the problem."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.skinny_gemm import _TUNED, MAX_ROWS, _config, skinny_gemm, skinny_gemm_supported

COVERS = ("skinny_gemm", "skinny_gemm_supported")
gpu = pytest.mark.gpu


def _check(m: int, n: int, k: int, dtype: torch.dtype, with_bias: bool, pad: int = 0) -> None:
    gen = torch.Generator().manual_seed(m * 131 + n * 7919 + k)
    w = torch.randn(n, k + pad, generator=gen).to(dtype).cuda()[:, :k]  # rows `pad` elements apart
    x = torch.randn(m, k + pad, generator=gen).to(dtype).cuda()[:, :k]
    bias = torch.randn(n, generator=gen).to(dtype).cuda() if with_bias else None
    ref = x.double() @ w.double().T + (bias.double() if bias is not None else 0)
    out = skinny_gemm(x, w, bias, read_ahead=True)
    assert out.shape == (m, n) and out.dtype == dtype
    # float32 accumulation over k products, then one rounding to the dtype.
    scale = (x.double().abs() @ w.double().abs().T).max().item()
    atol = scale * (k * 2 * torch.finfo(torch.float32).eps + torch.finfo(dtype).eps)
    torch.testing.assert_close(out.double(), ref, rtol=torch.finfo(dtype).eps, atol=atol)
    for i in range(m):  # rows are independent: padding and the other rows change nothing
        assert torch.equal(out[i], skinny_gemm(x[i:i + 1], w, bias)[0]), i


@gpu
@pytest.mark.parametrize("m", [1, 2, 5, 7, 8])
@pytest.mark.parametrize("n, k", [(48, 576), (64, 1536), (32, 320), (4096, 4096)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_skinny_gemm_matches_the_product(m, n, k, dtype):
    _check(m, n, k, dtype, with_bias=m % 2 == 0)


@gpu
def test_skinny_gemm_reads_strided_rows():
    _check(5, 64, 1024, torch.bfloat16, with_bias=True, pad=8)


@gpu
@pytest.mark.parametrize("n, k", sorted({(6144, 4096), (128256, 4096), (3072, 2048), (2048, 2048), *_TUNED}))
def test_skinny_gemm_at_the_8b_and_1b_shapes(n, k):
    _check(5, n, k, torch.bfloat16, with_bias=False)


def test_the_configurations_tile_k_exactly():
    """Every K the rule takes is whole tiles in every warp's segment; no 64-multiple means no tiling."""
    for k in (64, 320, 576, 1536, 2048, 4096, 8192, 14336):
        _, block_k, splits, _ = _config(16, k)
        assert k % (block_k * splits) == 0, k
    assert _config(16, 100) is None
    for (n, k), (block_n, block_k, splits, row_warps) in _TUNED.items():
        assert n % block_n == 0 and k % (block_k * splits) == 0 and block_n % (16 * row_warps) == 0


@pytest.mark.parametrize("x_shape, w_shape, dtype, why", [
    ((2, 64), (32, 64), torch.float32, "float32"),
    ((MAX_ROWS + 1, 64), (32, 64), torch.bfloat16, "too many rows"),
    ((2, 64), (24, 64), torch.bfloat16, "N not a multiple of 16"),
    ((2, 100), (32, 100), torch.bfloat16, "K not a multiple of 64"),
    ((2, 64), (32, 128), torch.bfloat16, "K differs"),
])
def test_skinny_gemm_refuses_what_it_cannot_run(x_shape, w_shape, dtype, why):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, w = torch.zeros(x_shape, dtype=dtype, device=device), torch.zeros(w_shape, dtype=dtype, device=device)
    assert not skinny_gemm_supported(x, w), why
    with pytest.raises(ValueError, match="skinny_gemm needs"):
        skinny_gemm(x, w)


def test_skinny_gemm_needs_a_gpu():
    x, w = torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(32, 64, dtype=torch.bfloat16)
    assert not skinny_gemm_supported(x, w)
    with pytest.raises(ValueError, match="on cpu"):
        skinny_gemm(x, w)


@gpu
def test_skinny_gemm_refuses_a_bad_bias():
    x, w = torch.zeros(2, 64, dtype=torch.bfloat16, device="cuda"), torch.zeros(32, 64, dtype=torch.bfloat16,
                                                                               device="cuda")
    with pytest.raises(ValueError, match="bias"):
        skinny_gemm(x, w, torch.zeros(16, dtype=torch.bfloat16, device="cuda"))
