"""DeepSeek-V3's multi-token-prediction (MTP) layer, the drafter of `SpecConfig.method` "mtp".

The checkpoint ships it after the decoder as `model.layers.{num_hidden_layers}.*`: `enorm`
and `hnorm` (RMSNorms), `eh_proj` (hidden * 2 -> hidden), one decoder layer of the
model's kind at that index (MLA, and MoE or dense as `MoEArch.is_moe_layer` says), and
`shared_head.norm`; its `embed_tokens` and `shared_head.head` are copies of the model's
embedding and LM head (DeepSeek-V3 shares them), which the model uses instead.

Given the target's hidden state h before token t, the layer's input is
x = eh_proj([enorm(embed(t)) | hnorm(h)]) (vLLM's and SGLang's order), and its output,
normalized by `shared_head.norm`, scores the token after the next one through the LM head.
h is the target's final hidden state (after its last norm, as vLLM and SGLang feed it);
drafting on, the layer's own normalized output (SGLang's choice).

Where the pair (h_{i-1}, t_i) sits: at token i's slot and position, so that the layer's KV
at a slot, like the target's, depends only on the tokens up to it (the prefix cache and a
KV transfer carry it as one more layer of the pool), and it predicts token i + 1, as the
target at i does: drafting starts one token after the target's last. Token 0 has no h
before it: zeros.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.models.arch import ModelArch
from pdserve.engine.models.layers import AttentionStep, DecoderLayer, Linear, RMSNorm
from pdserve.engine.models.rope import Rope


class SharedHead(nn.Module):
    """`shared_head`: only its norm is the layer's own (the head is the model's LM head)."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class MTPLayer(nn.Module):
    def __init__(self, arch: ModelArch, layer: DecoderLayer) -> None:
        super().__init__()
        self.enorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.hnorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.eh_proj = Linear(2 * arch.hidden_size, arch.hidden_size, bias=False)
        self.layer = layer
        self.shared_head = SharedHead(arch)

    def inputs(self, embeds: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """embeds [T, hidden] of tokens t_i, previous [T, hidden] the hidden states before
        each -> the decoder layer's input [T, hidden]."""
        return self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(previous)), dim=-1))

    def latents(self, embeds: torch.Tensor, previous: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's KV for these tokens without running it: (kv_c [T, kv_lora_rank]
        normalized, k_pe [T, qk_rope] not yet rotated), what its attention would write."""
        x = self.layer.input_layernorm(self.inputs(embeds, previous))
        return self.layer.self_attn.latent(x)

    def forward(self, embeds: torch.Tensor, previous: torch.Tensor, rope: Rope, attn: AttentionStep) -> torch.Tensor:
        """-> the normalized output [T, hidden]: the LM head's input, and the next draft's `previous`."""
        x, residual = self.layer(self.inputs(embeds, previous), None, rope, attn)
        return self.shared_head.norm.add_and_norm(x, residual)[0]
