"""Drafting with a model: a separate small draft model, or the target's first layers.

The draft runs over its own paged KV cache in the same worker, through the
same ModelRunner as the target. For each target sequence it keeps a shadow
sequence whose KV covers the tokens the draft has seen; a proposal first
catches the draft up on the target's new tokens (on a decode worker, the whole
prompt the first time: the draft's KV is built from the prompt received), then
drafts one token per step.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from pdserve.engine.attention import backend_for
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import MAX_SPECULATIVE_TOKENS
from pdserve.engine.engine import Engine
from pdserve.engine.kv_pool import KVLayout, KVPool
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.models.arch import ModelArch
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.engine.sampler import Sampler
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine.sequence import Sequence
from pdserve.engine.speculator import Proposal
from pdserve.engine.step_inputs import StepInputBuilder
from pdserve.engine.weights import load_model, load_tokenizer, resolve_model


class ModelDrafter:
    def __init__(self, model: LlamaForCausalLM, target: Engine, name: str) -> None:
        arch = model.arch
        bs = target.pool.layout.block_size
        # As many tokens as the target's pool, plus the drafted tail of every running sequence.
        num_blocks = target.pool.num_blocks + target.config.scheduler.max_num_seqs * -(-MAX_SPECULATIVE_TOKENS // bs)
        layout = KVLayout(name, target.dtype, arch.num_layers, arch.num_kv_heads, arch.head_dim, bs)
        num_bytes = layout.bytes_per_block * num_blocks
        if target.device.type == "cuda" and num_bytes > torch.cuda.mem_get_info(target.device)[0]:
            raise ValueError(f"no GPU memory left for the draft's KV cache ({num_blocks} blocks of "
                             f"{layout.bytes_per_block} bytes): lower CacheConfig.gpu_memory_utilization "
                             f"or set CacheConfig.num_blocks")
        self.pool = KVPool(layout, num_blocks, target.device)
        self.block_manager = BlockManager(num_blocks, bs, enable_prefix_caching=False)
        # The target's sampler: the same filtering (temperature, top-k/p) and the request's own random stream.
        self.sampler: Sampler = target.sampler
        sched = target.config.scheduler
        inputs = StepInputBuilder(bs, -(-target.max_model_len // bs) + 1, sched.max_num_batched_tokens,
                                  sched.max_num_seqs, target.device, growable=True)
        self.runner = ModelRunner(model, self.pool, backend_for(target.device), target.sampler, inputs)
        self._shadows: dict[Sequence, Sequence] = {}

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Proposal]:
        shadows = [self._sync(seq) for seq in seqs]
        drafted: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        while active:
            batch = ScheduledBatch()
            for i in active:
                shadow = shadows[i]
                num_new = shadow.num_tokens - shadow.num_computed_tokens
                if self.block_manager.allocate(shadow, num_new):  # else: the draft pool is full, propose less
                    batch.seqs.append(shadow)
                    batch.num_new_tokens.append(num_new)
            if not batch.seqs:
                break
            logits = self.runner.compute_logits(batch)
            for shadow, num_new in zip(batch.seqs, batch.num_new_tokens):
                shadow.num_computed_tokens += num_new
            active = [i for i in active if shadows[i] in logits]
            for i in active:
                token, q = self._draw(seqs[i], logits[shadows[i]])
                shadows[i].token_ids.append(token)
                drafted[i].append(token)
                if q is not None:
                    probs[i].append(q)
            # The last drafted token is not fed: the target computes its KV if it is accepted.
            active = [i for i in active if len(drafted[i]) < num_tokens[i]]
        return [Proposal(d, torch.cat(q) if q else None) for d, q in zip(drafted, probs)]

    def release(self, seq: Sequence) -> None:
        shadow = self._shadows.pop(seq, None)
        if shadow is not None:
            self.block_manager.free(shadow)

    def _sync(self, seq: Sequence) -> Sequence:
        """The shadow of `seq`, its KV kept only where the draft saw the target's tokens."""
        shadow = self._shadows.get(seq)
        if shadow is None:
            shadow = Sequence(seq.request_id, seq.prompt_token_ids, seq.params, self.block_manager.block_size)
            self._shadows[seq] = shadow
        # Positions past the target's last token, and drafted ones the target
        # replaced, hold KV of rejected guesses. Guesses only ever sit in the last
        # MAX_SPECULATIVE_TOKENS positions, so the scan is short. The target's last
        # token is always recomputed: its logits give the first proposal.
        valid = min(shadow.num_computed_tokens, seq.num_tokens - 1)
        for pos in range(max(0, valid - MAX_SPECULATIVE_TOKENS), valid):
            if shadow.token_ids[pos] != seq.token_ids[pos]:
                valid = pos
                break
        shadow.num_computed_tokens = valid
        del shadow.token_ids[valid:]
        shadow.token_ids.extend(seq.token_ids[valid:])
        self.block_manager.trim(shadow, valid)
        return shadow

    def _draw(self, seq: Sequence, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """The next draft token from logits [1, vocab], and the distribution it was drawn from."""
        if seq.params.greedy:
            return int(logits[0].argmax().item()), None
        q = self.sampler.probs(logits, seq.params)
        gen = self.sampler.generator(seq.request_id, seq.params)
        return int(torch.multinomial(q[0], 1, generator=gen).item()), q


def self_draft_model(target: LlamaForCausalLM, num_layers: int) -> LlamaForCausalLM:
    """The target cut after `num_layers` layers: same embedding, final norm and
    head, no weights of its own (an untrained early exit)."""
    if not 1 <= num_layers <= target.arch.num_layers:
        raise ValueError(f"self-draft layers must be in [1, {target.arch.num_layers}] (the target's), "
                         f"got {num_layers}")
    with torch.device("meta"):
        draft = LlamaForCausalLM(replace(target.arch, num_layers=0), 1, torch.device("meta"))
    draft.arch = replace(target.arch, num_layers=num_layers)
    draft.embed_tokens = target.embed_tokens
    draft.layers = nn.ModuleList(list(target.layers)[:num_layers])
    draft.norm = target.norm
    draft.lm_head = target.lm_head
    draft.rotary = target.rotary
    return draft.eval()


def load_draft_model(source: str, target: Engine) -> LlamaForCausalLM:
    """Load the draft named by `source` on the target's device and dtype, after
    checking (ValueError) that it can draft for the target at all."""
    config = replace(target.config.model, source=source, max_model_len=None)
    files = resolve_model(config)
    check_draft(files.arch, load_tokenizer(files), target.arch, target.tokenizer, target.max_model_len)
    return load_model(files, target.max_model_len, target.device, target.dtype, config.seed)


def check_draft(draft: ModelArch, draft_tokenizer: Any | None, target: ModelArch, target_tokenizer: Any | None,
                max_model_len: int) -> None:
    """Refuse a draft that cannot propose for the target (ValueError)."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"draft vocabulary size {draft.vocab_size} differs from the target's {target.vocab_size}")
    if (draft_tokenizer is None) != (target_tokenizer is None):
        raise ValueError("draft and target must both have a tokenizer or both have none")
    if draft_tokenizer is not None and draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError("draft tokenizer differs from the target's (token ids would not mean the same text)")
    if draft.num_params > target.num_params:
        raise ValueError(f"draft model ({draft.num_params / 1e6:.1f}M parameters) is larger than the target "
                         f"({target.num_params / 1e6:.1f}M): it would slow decoding down")
    if draft.max_position_embeddings < max_model_len:
        raise ValueError(f"draft context {draft.max_position_embeddings} is shorter than max_model_len {max_model_len}")
