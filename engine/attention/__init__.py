"""Attention over the paged KV pool: metadata built once per step, one backend per device."""

from __future__ import annotations

import torch

from pdserve.engine.attention.base import AttentionBackend, AttentionMetadata


def backend_for(device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """Triton kernels on CUDA, the torch reference elsewhere, for a model computing in dtype."""
    if device.type == "cuda":
        from pdserve.engine.attention.triton_backend import TritonAttention

        return TritonAttention(dtype)
    from pdserve.engine.attention.torch_ref import TorchAttention

    return TorchAttention()


__all__ = ["AttentionBackend", "AttentionMetadata", "backend_for"]
