"""Triton kernels of pdserve: FlashAttention prefill (and a Gluon one for Hopper, for
prompts without earlier context), paged decode, the block-to-block copy of the KV
transport's direct path, the decoder layer's small steps (the rotary embedding fused with
the paged KV cache write, RMSNorm fused with the residual add, SwiGLU's silu-and-mul), the
one-row linear layer of a batch-1 decode step (GEMV) and the few-row one of a verification
(a skinny GEMM on the tensor cores, in Gluon), and sampling at a temperature in one
pass (Gumbel-max). The cache holds the model's dtype or FP8 (e4m3, `fp8.py`).

One file per kernel family; each holds private @triton.jit kernels and one public
launcher that checks shapes, dtypes and strides. Without a GPU, set TRITON_INTERPRET=1
before importing (tests do) to run them in Triton's interpreter.
"""

from __future__ import annotations

from pdserve.kernels.activation import silu_and_mul
from pdserve.kernels.block_copy import copy_blocks
from pdserve.kernels.flash_prefill import flash_prefill
from pdserve.kernels.flash_prefill_ws import flash_prefill_ws, flash_prefill_ws_paged, flash_prefill_ws_supported
from pdserve.kernels.fp8 import check_cache_dtype, quantize
from pdserve.kernels.gemv import gemv
from pdserve.kernels.paged_decode import (
           decode_num_splits,
           decode_workspace,
           paged_decode,
           paged_verify,
           paged_verify_fits,
)
from pdserve.kernels.rms_norm import rms_norm
from pdserve.kernels.rotary import rotary_cache_write
from pdserve.kernels.sampling import gumbel_argmax
from pdserve.kernels.skinny_gemm import skinny_gemm, skinny_gemm_supported

__all__ = ["check_cache_dtype", "copy_blocks", "decode_num_splits", "decode_workspace", "flash_prefill",
           "flash_prefill_ws", "flash_prefill_ws_paged", "flash_prefill_ws_supported", "gemv", "gumbel_argmax",
           "paged_decode", "paged_verify", "paged_verify_fits", "quantize", "rms_norm", "rotary_cache_write",
           "silu_and_mul", "skinny_gemm", "skinny_gemm_supported"]
