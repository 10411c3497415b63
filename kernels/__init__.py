"""Triton kernels of pdserve: paged KV cache write, FlashAttention prefill, paged decode.

One file per kernel family; each holds private @triton.jit kernels and one public
launcher that checks shapes, dtypes and strides. Without a GPU, set TRITON_INTERPRET=1
before importing (tests do) to run them in Triton's interpreter.
"""

from __future__ import annotations

from kernels.cache_write import cache_write
from kernels.flash_prefill import flash_prefill
from kernels.paged_decode import decode_num_splits, decode_workspace, paged_decode

__all__ = ["cache_write", "decode_num_splits", "decode_workspace", "flash_prefill", "paged_decode"]
