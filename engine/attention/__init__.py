"""Attention over the paged KV pool: metadata built once per step, one backend per device."""

from __future__ import annotations

import torch

from pdserve.engine.attention.base import AttentionBackend, AttentionMetadata


def backend_for(device: torch.device, dtype: torch.dtype, fp8_dot: bool = False) -> AttentionBackend:
    """Triton kernels on CUDA, the torch reference elsewhere, for a model computing in dtype.
    fp8_dot: decode and verification attention multiply an FP8 pool's values as e4m3
    (`CacheConfig.fp8_attention_dot`), a mode of the Triton kernels only."""
    if device.type == "cuda":
        from pdserve.engine.attention.triton_backend import TritonAttention

        return TritonAttention(dtype, fp8_dot)
    if fp8_dot:
        raise ValueError(f"CacheConfig.fp8_attention_dot is a mode of the CUDA (Triton) attention kernels; "
                         f"{device.type}'s torch attention has none")
    from pdserve.engine.attention.torch_ref import TorchAttention

    return TorchAttention()


__all__ = ["AttentionBackend", "AttentionMetadata", "backend_for"]
