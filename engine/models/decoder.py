"""What the runner, the CUDA graphs, tensor parallelism and the drafter need of a model:
`CausalLM`, the decoder skeleton every family shares (embedding, decoder layers, final
norm, LM head, rotary tables). A family is a subclass that says how to build layer i
(`make_layer`); everything else, weight loading included, is here and in loading.py.

The model never sees the cache layout: each layer hands q, k, v and the step's rotary
embedding to the step's attention callable, which rotates q and k, writes k, v into the
pool and attends. Under tensor parallelism the logits of the vocabulary shards are
all-gathered, so every rank returns the whole vocabulary's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pdserve.engine.models import fp8, loading
from pdserve.engine.models.arch import ModelArch
from pdserve.engine.models.layers import AttentionStep, DecoderLayer, Linear, RMSNorm, VocabParallelEmbedding
from pdserve.engine.models.moe import FusedExperts
from pdserve.engine.models.mtp import MTPLayer
from pdserve.engine.models.parallel import TensorParallel
from pdserve.engine.models.rope import RotaryEmbedding


class CausalLM(nn.Module):
    """A decoder-only language model over a paged KV cache (one rank's shard of it).

    Subclasses implement `make_layer`; their layers take and return (x, residual) as
    layers.DecoderLayer does. `mtp`: a multi-token-prediction layer (models/mtp.py) where the
    family has one and the arch asks for it (DeepSeek-V3), else None.
    """

    def __init__(self, arch: ModelArch, max_positions: int, device: torch.device,
                 tp: TensorParallel | None = None) -> None:
        """tp: this rank's shard and collectives (None: the whole model, one rank)."""
        super().__init__()
        self.arch = arch
        self.tp = tp = tp or TensorParallel.single(arch)
        self.embed_tokens = VocabParallelEmbedding(tp, arch.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(arch, i, tp) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = Linear(arch.hidden_size, tp.plan.vocab_per_rank, bias=False)
        self.tie_weights()
        self.rotary = RotaryEmbedding(arch.rope, arch.head_dim, max_positions, device)
        self.mtp: MTPLayer | None = None

    @staticmethod
    def make_layer(arch: ModelArch, layer_idx: int, tp: TensorParallel) -> DecoderLayer:
        """Layer `layer_idx` of this family, this rank's shard of it."""
        raise NotImplementedError

    def tie_weights(self) -> None:
        """Share the embedding with the LM head (again after `to_empty`, which unties them)."""
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def use_fp8_weights(self, blocked: bool) -> None:
        """Hold the decoder layers' linear layers (`fp8.LAYERS`; not the embedding, the norms,
        a router or the LM head) and MoE experts in FP8, with per-channel scales or per-block
        ones when `blocked`. Before `load_weights`:
        the checkpoint (or `fp8.quantized_online`) fills them."""
        for name, module in self.named_modules():
            if isinstance(module, Linear) and name.rsplit(".", 1)[-1] in fp8.LAYERS:
                module.use_fp8(blocked)
            elif isinstance(module, FusedExperts):
                module.use_fp8(blocked)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionStep) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]."""
        x, residual, rope = self.embed_tokens(input_ids), None, self.rotary.at(positions)
        for layer in self.layers:
            x, residual = layer(x, residual, rope, attn)
        if residual is None:  # no layers
            return self.norm(x)
        return self.norm.add_and_norm(x, residual)[0]

    def mtp_latents(self, input_ids: torch.Tensor, previous: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer's KV of tokens input_ids [T] after hidden states previous [T, hidden]
        (`MTPLayer.latents`), without running the layer."""
        assert self.mtp is not None
        return self.mtp.latents(self.embed_tokens(input_ids), previous)

    def mtp_forward(self, input_ids: torch.Tensor, previous: torch.Tensor, positions: torch.Tensor,
                    attn: AttentionStep) -> torch.Tensor:
        """The MTP layer over tokens input_ids [T] at positions [T] after hidden states
        previous [T, hidden] -> its normalized output [T, hidden] (`compute_logits` scores it)."""
        assert self.mtp is not None
        return self.mtp(self.embed_tokens(input_ids), previous, self.rotary.at(positions), attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 (on every rank: the shards' logits are gathered)."""
        logits = self.lm_head(hidden).float()
        if self.tp.comm.size == 1:
            return logits
        return self.tp.comm.all_gather(logits)[:, :self.arch.vocab_size]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors, fusing on the way and keeping this rank's slice
        of each (every rank reads the whole tensors). Raises ValueError naming any missing,
        unexpected or misshapen tensor."""
        loading.load(self, self.arch, self.tp.plan, weights)
