"""Multi-head latent attention (DeepSeek-V2/V3), this rank's heads of it.

Each token's KV is compressed to one latent: `kv_a_proj_with_mqa` gives kv_lora_rank values
(normalized by `kv_a_layernorm`) and a key part of qk_rope_head_dim shared by every head,
rotated. The pool stores those two side by side (`KVLayout` kind "mla"); `kv_b_proj`
expands a latent to each head's no-rope key and value, which the attention step does for
prefill, or folds into the queries and the output for decode (`MLAProjection.absorbed`).
The module hands the step q, the latent and the key part (not rotated) with the projection;
the step rotates, writes the pool and attends (`AttentionStep.mla`). A checkpoint's
interleaved rotary pairs (`MLAArch.rope_interleave`) are put in rotate-half order once, after
loading, by reordering the rows of the projections that make them
(`deinterleave_rope_rows`): no reordering on a step's path (it was three copies a layer).

Under tensor parallelism the heads split (q_proj / q_b_proj and kv_b_proj column-parallel,
o_proj row-parallel); the latent projections are whole on every rank, and so is the pool.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.models.arch import MLAArch, ModelArch
from pdserve.engine.models.fp8 import SCALE_BLOCK
from pdserve.engine.models.layers import AttentionStep, Linear, MLAProjection, RMSNorm, RowParallelLinear
from pdserve.engine.models.parallel import TensorParallel
from pdserve.engine.models.rope import Rope

LATENT_NORM_EPS = 1e-6  # q_a_layernorm's and kv_a_layernorm's: transformers builds them with its default


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., D] pairs (x0, x1), (x2, x3), ... -> [evens | odds]: the rotate-half layout, in
    which the rotation is the same (transformers' `apply_rotary_pos_emb_interleave`)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MLAAttention(nn.Module):
    def __init__(self, arch: ModelArch, layer_idx: int, tp: TensorParallel) -> None:
        super().__init__()
        mla = arch.mla
        assert mla is not None
        self.mla: MLAArch = mla
        self.layer_idx = layer_idx
        self.num_heads = tp.plan.num_heads
        q_width = self.num_heads * mla.qk_head_dim
        self.q_proj: Linear | None = None
        if mla.q_lora_rank is None:
            self.q_proj = Linear(arch.hidden_size, q_width, bias=False)
        else:
            self.q_a_proj = Linear(arch.hidden_size, mla.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(mla.q_lora_rank, q_width, bias=False)
        self.kv_a_proj_with_mqa = Linear(arch.hidden_size, mla.latent_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(mla.kv_lora_rank, self.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                                bias=False)
        self.o_proj = RowParallelLinear(self.num_heads * mla.v_head_dim, arch.hidden_size, False, tp)
        self.rope_rows_deinterleaved = False  # set by deinterleave_rope_rows

    def forward(self, x: torch.Tensor, rope: Rope, attn: AttentionStep) -> torch.Tensor:
        mla, num_tokens = self.mla, x.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(num_tokens, self.num_heads, mla.qk_head_dim)
        kv_c, k_pe = self.latent(x)
        if mla.rope_interleave and not self.rope_rows_deinterleaved:
            q_nope, q_pe = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
            q = torch.cat((q_nope, deinterleave(q_pe)), dim=-1)
        projection = MLAProjection(self.kv_b_proj, self.num_heads, mla.qk_nope_head_dim, mla.v_head_dim)
        out = attn.mla(self.layer_idx, q, kv_c, k_pe, rope, projection)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * mla.v_head_dim))

    def latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] (normalized) -> what the pool holds of these tokens, before the
        rotation: (kv_c [T, kv_lora_rank] normalized, k_pe [T, qk_rope] in rotate-half order)."""
        mla = self.mla
        kv_c, k_pe = self.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c.contiguous())
        if mla.rope_interleave and not self.rope_rows_deinterleaved:
            k_pe = deinterleave(k_pe)
        return kv_c, k_pe.contiguous()

    @torch.no_grad()
    def deinterleave_rope_rows(self) -> None:
        """Once the weights are loaded (each load writes them in the checkpoint's order): the
        output rows of the query projection's rope part (each head's last qk_rope_head_dim)
        and of kv_a_proj_with_mqa's key part put in rotate-half order, with their per-channel
        scales (block scales stay: the rows move within a 64-row run, inside a 128-row block),
        so that q and k_pe come out as `deinterleave` would make them."""
        mla = self.mla
        if not mla.rope_interleave:
            return
        device = self.kv_a_proj_with_mqa.weight.device
        rope = deinterleave(torch.arange(mla.qk_rope_head_dim, device=device))
        head = torch.cat((torch.arange(mla.qk_nope_head_dim, device=device), mla.qk_nope_head_dim + rope))
        heads = torch.arange(self.num_heads, device=device)[:, None] * mla.qk_head_dim
        q_proj = self.q_proj if self.q_proj is not None else self.q_b_proj
        _reorder_rows(q_proj, (heads + head).flatten())
        _reorder_rows(self.kv_a_proj_with_mqa,
                      torch.cat((torch.arange(mla.kv_lora_rank, device=device), mla.kv_lora_rank + rope)))
        self.rope_rows_deinterleaved = True


def _reorder_rows(layer: Linear, rows: torch.Tensor) -> None:
    """Row i of layer's weight (and per-channel scale) becomes its row rows[i]; block scales
    are kept, which `rows` must allow (each row stays in its 128-row block)."""
    layer.weight.copy_(layer.weight[rows])
    scale = layer.weight_scale
    if scale is None:
        return
    if layer.fp8_blocked:
        block = torch.arange(rows.numel(), device=rows.device) // SCALE_BLOCK
        assert torch.equal(rows // SCALE_BLOCK, block), "a rope row would leave its 128-row scale block"
    else:
        scale.copy_(scale[rows])
