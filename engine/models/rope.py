"""Rotary position embedding (default, linear, Llama-3 and YaRN frequency scaling)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pdserve.engine.models.arch import RopeConfig


def inv_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[head_dim // 2] float32, the same values as transformers computes."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "yarn":
        return _yarn_inv_frequencies(rope, head_dim)
    if rope.rope_type != "llama3":
        return inv_freq
    # Llama 3: long wavelengths are slowed by `factor`, short ones kept, the band
    # between interpolated smoothly.
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_frequencies(rope: RopeConfig, dim: int) -> torch.Tensor:
    """YaRN: frequencies past the beta_fast rotations kept, those below beta_slow divided by
    `factor`, a linear ramp between (transformers' `_compute_yarn_parameters`)."""
    def correction_dim(num_rotations: float) -> float:
        old_len = rope.original_max_position_embeddings
        return dim * math.log(old_len / (num_rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    return 1.0 / (rope.factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation


class RotaryEmbedding:
    """Precomputed cos/sin tables indexed by position.

    Plain tensors, not module buffers: they stay float32 on `device` whatever
    dtype or device the model's weights are moved to.
    """

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, device: torch.device) -> None:
        with torch.device(device):  # also inside a meta-device model construction
            inv_freq = inv_frequencies(rope, head_dim)
            positions = torch.arange(max_positions, dtype=torch.float32)
            freqs = positions[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
        scale = rope.cos_sin_scale  # YaRN's attention factor (1 for the other types)
        self.cos = emb.cos() * scale  # [max_positions, head_dim] float32
        self.sin = emb.sin() * scale

    def at(self, positions: torch.Tensor) -> Rope:
        """The rotation of a step's tokens, for its attention to apply."""
        return Rope(positions, self.cos, self.sin)


@dataclass(frozen=True, slots=True)
class Rope:
    """The rotary embedding of one step's tokens: positions [T] and the tables. The
    attention step applies it (on CUDA fused with the KV cache write,
    `kernels.rotary_cache_write`); `__call__` is transformers' own arithmetic, the CPU's
    and the kernels' reference."""

    positions: torch.Tensor
    cos: torch.Tensor  # [max_positions, head_dim] float32, both halves equal
    sin: torch.Tensor

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hkv, D] -> new rotated q, k (same dtypes)."""
        cos = self.cos[self.positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[self.positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
