"""y = x @ W.T (+ b) for 2-8 rows of x: a batch-1 verification (K + 1 rows), a draft's
catch-up steps, a decode step of a few sequences.

At a few rows a linear layer is still a weight read, but cuBLAS reads the weights more
slowly than the one-row GEMV does, splits K over a second (reduce) kernel for the
narrower layers, and cannot launch early under programmatic dependent launch, so every
one of its GEMMs breaks the step's chain of early launches. The Gluon kernel
(`_gluon_skinny_gemm`) multiplies on the tensor cores with the weights loaded straight
into the MMA's registers, splits K over each program's warps and sums them once, and
launches with PDL. On the H200, dummy Llama-3.1-8B, 1k context, the batch-1 verification
of 5 tokens fell from 4.66 to 4.11 ms a pass, the decode step at batch 2-8 by 10%
(benchmarks/RESULTS.md, "A skinny GEMM on the tensor cores").
"""

from __future__ import annotations

import functools
import logging

import torch

from pdserve.kernels import _pdl

logger = logging.getLogger(__name__)

try:
    from pdserve.kernels import _gluon_skinny_gemm as _gluon
except (ImportError, AttributeError, TypeError) as e:  # another Triton's Gluon: linear layers keep cuBLAS
    logger.info("Gluon skinny GEMM unavailable with this Triton (%s): cuBLAS serves few-row products", e)
    _gluon = None  # type: ignore[assignment]

MAX_ROWS = 8  # _gluon_skinny_gemm.ROWS: more rows lost to cuBLAS
_DTYPES = (torch.bfloat16, torch.float16)
_ROW_TILE = 16  # one warp's rows of W: the MMA's M

# (N, K) -> (BLOCK_N, BLOCK_K, S, WN) where a sweep on the H200 (5 rows, cold weights, CUDA
# graphs; benchmarks/RESULTS.md, "A skinny GEMM on the tensor cores") beat the rule below.
_TUNED: dict[tuple[int, int], tuple[int, int, int, int]] = {
    (4096, 4096): (16, 256, 4, 1),
    (28672, 4096): (16, 128, 2, 1),
    (4096, 14336): (16, 128, 8, 1),
    (16384, 2048): (32, 128, 2, 2),
    (2048, 8192): (16, 256, 8, 1),
}


@functools.cache
def _config(n: int, k: int) -> tuple[int, int, int, int] | None:
    """(BLOCK_N, BLOCK_K, S, WN): the sweep's choice for a shape it timed, else 16 rows of W a
    program, 128-column tiles (64 where K needs them), K split over 4 warps (8 from K = 8192
    on; fewer where K does not divide). None: no tiling fits (K not a multiple of 64)."""
    if (n, k) in _TUNED:
        return _TUNED[n, k]
    block_k = 128 if k % 128 == 0 else 64
    if k % block_k:
        return None
    splits = 8 if k >= 8192 else 4
    while k % (block_k * splits):
        splits //= 2
    return _ROW_TILE, block_k, splits, 1


@functools.cache
def _has_mma(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8


def skinny_gemm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether skinny_gemm runs this product: an NVIDIA GPU with mma.sync for 16-bit floats
    (compute capability 8.0 or later), x and weight of one dtype (bf16 or fp16), 1 to
    MAX_ROWS rows, N a multiple of 16, K a multiple of 64, contiguous columns, and a Triton
    with the Gluon API. Cheap: the engine asks it for every linear layer it runs eagerly."""
    return (_gluon is not None and x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.dtype in _DTYPES
            and weight.dim() == 2 and weight.dtype == x.dtype and x.shape[1] == weight.shape[1]
            and weight.shape[0] % _ROW_TILE == 0 and x.stride(1) == 1 and weight.stride(1) == 1
            and _has_mma(x.device) and _config(*weight.shape) is not None)


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                read_ahead: bool = False) -> torch.Tensor:
    """x [M, K] @ weight.T [K, N] (+ bias [N]) -> [M, N] in x's dtype, for M <= MAX_ROWS;
    accumulates in float32, and each row rounds as it would alone (rows are independent).

    read_ahead: the weights were final before the kernel preceding this one started (a
    model's, once loaded): read their first tile before waiting for it (`kernels._pdl`).

    Raises ValueError where `skinny_gemm_supported` is false. One launch, no host sync:
    safe to capture in a CUDA graph.
    """
    if not skinny_gemm_supported(x, weight):
        raise ValueError(f"skinny_gemm needs a CUDA GPU of compute capability 8.0+ with Triton's Gluon, x [M <= "
                         f"{MAX_ROWS}, K] and weight [N, K] of one dtype (bf16/fp16), N a multiple of {_ROW_TILE}, "
                         f"K of 64, contiguous columns; got x {tuple(x.shape)} {x.dtype} on {x.device}, weight "
                         f"{tuple(weight.shape)} {weight.dtype}, strides {x.stride()} / {weight.stride()}")
    n, k = weight.shape
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype or bias.stride(0) != 1):
        raise ValueError(f"skinny_gemm's bias must be [{n}] contiguous of {x.dtype}; got {tuple(bias.shape)} "
                         f"{bias.dtype}")
    config = _config(n, k)
    assert config is not None  # skinny_gemm_supported checked it
    block_n, block_k, splits, row_warps = config
    y = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    _gluon.launch(x, weight, bias, y, block_n, block_k, splits, row_warps, _pdl.pdl(x), read_ahead)
    return y
