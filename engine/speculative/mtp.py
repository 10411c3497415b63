"""Drafting with the target's own multi-token-prediction layer (DeepSeek-V3's MTP,
engine/models/mtp.py), `SpecConfig.method` "mtp".

The layer's KV over a sequence's tokens is already in the target's pool (its last layer:
the target's steps write it, runner/mtp_carry.py), and so is the target's hidden state
before the sequence's last token. A proposal runs the layer K times, one token per
sequence each time: first on the last token after that hidden state, then on each drafted
token after the layer's own output before it (as vLLM and SGLang chain it). Those K
entries are the chain's only (the pool's slots there are the target's to write when it
verifies them), so its attention reads the pool's entries before the last token and the
chain's kept here, in torch (the absorbed form, `mla_absorbed`).
"""

from __future__ import annotations

import torch

from pdserve.engine.attention.mla_ref import mla_absorbed
from pdserve.engine.kv.pool import KVPool
from pdserve.engine.models.decoder import CausalLM
from pdserve.engine.models.layers import HeadNorm, MLAProjection
from pdserve.engine.models.rope import Rope
from pdserve.engine.runner.mtp_carry import MTPCarry
from pdserve.engine.sampler import Sampler, on_device
from pdserve.engine.sequence import Sequence
from pdserve.engine.speculative.drafter import HostDrafter
from pdserve.engine.speculator import Proposals


class _ChainAttention:
    """The MTP layer's attention while drafting (`AttentionStep`, MLA only) for a batch of
    sequences, one query each per call: over each one's entries in the pool (its tokens
    before the last), then the chain's own so far."""

    def __init__(self, pool: KVPool, layer_idx: int, seqs: list[Sequence], scale: float) -> None:
        cache = pool.latent(layer_idx)
        flat = cache.view(-1, cache.shape[-1])
        bs = pool.layout.block_size
        self.scale = scale
        self.layer_idx = layer_idx
        self.context = []  # per sequence [its tokens but the last, latent_dim]
        for seq in seqs:
            positions = torch.arange(seq.num_tokens - 1, device=flat.device)
            blocks = torch.tensor(seq.block_ids, dtype=torch.int64, device=flat.device)
            self.context.append(flat[blocks[positions // bs] * bs + positions % bs])
        self.chain: list[list[torch.Tensor]] = [[] for _ in seqs]

    def keep(self, rows: list[int]) -> None:
        """Only the sequences at `rows` draft on."""
        self.context = [self.context[r] for r in rows]
        self.chain = [self.chain[r] for r in rows]

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rope,
                 head_norm: HeadNorm | None = None) -> torch.Tensor:
        raise NotImplementedError("an MTP layer attends over latents (mla)")

    def mla(self, layer_idx: int, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, rope: Rope,
            projection: MLAProjection) -> torch.Tensor:
        assert layer_idx == self.layer_idx
        nope = projection.qk_nope_head_dim
        q_pe, k_pe = rope(q[..., nope:], k_pe.unsqueeze(1))
        q = torch.cat((q[..., :nope], q_pe), dim=-1)
        entries = torch.cat((kv_c, k_pe[:, 0]), dim=-1)  # [B, latent_dim]
        for chain, entry in zip(self.chain, entries):
            chain.append(entry)
        seqs = [torch.cat((ctx.to(q.dtype), torch.stack(chain).to(q.dtype))) for ctx, chain in zip(self.context,
                                                                                                    self.chain)]
        longest = max(x.shape[0] for x in seqs)
        latents = q.new_zeros((len(seqs), longest, entries.shape[-1]))
        mask = torch.zeros((len(seqs), 1, 1, longest), dtype=torch.bool, device=q.device)
        for b, x in enumerate(seqs):
            latents[b, :x.shape[0]] = x
            mask[b, ..., :x.shape[0]] = True
        return mla_absorbed(q, latents, mask, projection, self.scale)


class MTPDrafter(HostDrafter):
    """Implements `Drafter`. Nothing of its own to catch up on after a verification: the
    target's next step writes the accepted tokens' MTP entries with its own."""

    def __init__(self, model: CausalLM, carry: MTPCarry, pool: KVPool, sampler: Sampler) -> None:
        assert model.mtp is not None
        self.model = model
        self.carry = carry
        self.pool = pool
        self.sampler = sampler  # the target's: the same filtering and the request's own seeded draws
        self.device = pool.kv.device
        self.vocab_size = model.arch.vocab_size

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposals:
        n, width = len(seqs), max(num_tokens, default=0)
        drafted = torch.zeros((n, width), dtype=torch.int64, device=self.device)
        counts = [0] * n
        active = [i for i in range(n) if num_tokens[i] > 0]
        if not active:
            return Proposals(drafted, counts)
        hidden_size = self.model.arch.hidden_size
        dtype = self.model.embed_tokens.weight.dtype
        kept = [self.carry.row(seqs[i], seqs[i].num_tokens - 2) for i in active]
        previous = torch.stack([r if r is not None else torch.zeros(hidden_size, dtype=dtype, device=self.device)
                                for r in kept])
        tokens = on_device([seqs[i].token_ids[-1] for i in active], torch.int64, self.device)
        positions = on_device([seqs[i].num_tokens - 1 for i in active], torch.int64, self.device)
        attn = _ChainAttention(self.pool, self.carry.layer_idx, [seqs[i] for i in active],
                               self.model.arch.softmax_scale)
        want_probs = any(not seqs[i].params.greedy for i in active)
        probs: torch.Tensor | None = None
        for j in range(width):
            hidden = self.model.mtp_forward(tokens, previous, positions, attn)
            logits = self.model.compute_logits(hidden)
            tokens, q = self.sampler.draw(logits, [seqs[i].params for i in active],
                                          [seqs[i].next_output_index + j for i in active], want_probs, stream="draft")
            index = on_device(active, torch.int64, self.device)
            drafted[:, j].index_copy_(0, index, tokens)
            if q is not None:
                if probs is None:
                    probs = torch.zeros((n, width, self.vocab_size), dtype=torch.float32, device=self.device)
                probs[:, j].index_copy_(0, index, q)
            for i in active:
                counts[i] += 1
            rows = [r for r, i in enumerate(active) if counts[i] < num_tokens[i]]
            if not rows:
                break
            if len(rows) < len(active):
                keep = on_device(rows, torch.int64, self.device)
                tokens, hidden, positions = tokens[keep], hidden[keep], positions[keep]
                active = [active[r] for r in rows]
                attn.keep(rows)
            previous, positions = hidden, positions + 1
        return Proposals(drafted, counts, probs)

    def release(self, seq: Sequence) -> None:
        pass  # the carry forgets a sequence with it; its pool entries are its blocks'
