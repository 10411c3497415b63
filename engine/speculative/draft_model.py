"""Drafting with a model: a separate small draft model, or the target's first layers.

The draft runs over its own paged KV cache in the same worker, through the
same ModelRunner as the target. For each target sequence it keeps a shadow
sequence whose KV covers the tokens the draft has seen; a proposal first
catches the draft up on the target's new tokens (on a decode worker, the whole
prompt the first time: the draft's KV is built from the prompt received), then
drafts one token per step.

After a verification the catch-up starts before the host knows the outcome
(`catch_up`): the draft is fed every position the pass verified, with the tokens
the acceptance emitted there, on the device, right behind the verification; the
row after the last kept token gives the first draft token. The host reads the
pass meanwhile (`settle` tells the drafter how many were kept), so the GPU does
not wait for the host between a verification and the next proposal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.attention import backend_for
from pdserve.engine.config import MAX_SPECULATIVE_TOKENS
from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.kv.pool import KVLayout, KVPool
from pdserve.engine.models.decoder import CausalLM
from pdserve.engine.runner.cuda_graphs import StepGraphs
from pdserve.engine.runner.executor import Executor
from pdserve.engine.runner.model_runner import ModelRunner, StepLogits
from pdserve.engine.runner.step_inputs import InFlightTokens, StepInputBuilder
from pdserve.engine.sampler import Sampler, on_device
from pdserve.engine.scheduler import (
    ScheduledBatch,
    shadow_advance,
    shadow_append_placeholders,
    shadow_caught_up,
    shadow_fill_drafted,
    shadow_rewind,
)
from pdserve.engine.sequence import Sequence
from pdserve.engine.speculative.draft_loading import DraftTarget, first_ids, trim_head
from pdserve.engine.speculator import Proposals
from pdserve.kernels.paged_decode import paged_verify_fits


@dataclass(slots=True)
class _CaughtUp:
    """A shadow fed the positions a verification checked, from `start` on, `width` of them,
    before the host knew how many it kept; its first draft token's logits are row `row` of
    the drafter's `_caught_up_rows`. `kept` (set by `settle`): how many of the fed tokens
    are the target's (the accepted proposals and the target's own)."""

    start: int
    width: int
    row: int
    kept: int | None = None


class ModelDrafter:
    def __init__(self, model: CausalLM, target: DraftTarget, name: str,
                 head_ids: torch.Tensor | None = None) -> None:
        """head_ids: the token ids the draft's head keeps (`draft_head_ids`; None: all)."""
        if head_ids is not None:
            model = trim_head(model, head_ids)
        arch = model.arch
        bs = target.kv_layout.block_size
        # As many tokens as the target's pool, plus the drafted tail of every running sequence
        # (the engine counted them when it sized its own pool: `engine.kv_budget.draft_memory`).
        num_blocks = target.num_kv_blocks + target.scheduler.max_num_seqs * -(-MAX_SPECULATIVE_TOKENS // bs)
        layout = KVLayout(name, target.kv_layout.dtype, arch.num_layers, arch.num_kv_heads, arch.head_dim, bs)
        num_bytes = layout.bytes_per_block * num_blocks
        if target.device.type == "cuda" and num_bytes > torch.cuda.mem_get_info(target.device)[0]:
            raise ValueError(f"no GPU memory left for the draft's KV cache ({num_blocks} blocks of "
                             f"{layout.bytes_per_block} bytes): lower CacheConfig.gpu_memory_utilization "
                             f"or set CacheConfig.num_blocks")
        self.device = target.device
        # The target's vocabulary: the width of draft distributions (a trimmed head's are zero
        # elsewhere), and the ids of a trimmed head's columns when they are not its first ones.
        self.vocab_size = target.arch.vocab_size
        self._head_ids = None if head_ids is None or first_ids(head_ids) else head_ids.to(target.device)
        self.pool = KVPool(layout, num_blocks, target.device)
        self.block_manager = BlockManager(num_blocks, bs, enable_prefix_caching=False)
        # The target's sampler: the same filtering (temperature, top-k/p) and the request's own seeded draws.
        self.sampler: Sampler = target.sampler
        sched, spec = target.scheduler, target.spec
        # A fixed token budget per draft step (a sequence's first catch-up, its whole prompt,
        # goes in chunks of it), so that graphs can be captured over the buffers.
        self.max_step_tokens = max(sched.max_num_batched_tokens, sched.max_num_seqs * 2)
        inputs = StepInputBuilder(bs, -(-target.max_model_len // bs) + 1, self.max_step_tokens,
                                  sched.max_num_seqs, target.device)
        # The draft's attention widens its FP8 tiles whatever the target's fp8_attention_dot:
        # the target verifies every drafted token.
        executor = Executor(model, self.pool, backend_for(target.device, target.dtype))
        graphs = None
        if target.device.type == "cuda" and not target.model.enforce_eager:
            # Decodes, the steady catch-up of two tokens, and each verification's catch-up
            # (K + 1 positions, for every K adaptive K may pick).
            group = arch.num_heads // arch.num_kv_heads
            catch_ups = [k + 1 for k in range(1, spec.num_speculative_tokens + 1) if paged_verify_fits(k + 1, group)]
            graphs = StepGraphs(executor, inputs, min(sched.max_num_seqs, spec.max_graph_batch), (1, 2, *catch_ups))
            graphs.capture()
        self.runner = ModelRunner(executor, target.sampler, inputs, graphs)
        self._shadows: dict[Sequence, Sequence] = {}
        # The last proposal's tokens, still on the device: [(shadow, its row, tokens drafted)].
        self._drafted: tuple[torch.Tensor, list[tuple[Sequence, int, int]]] | None = None
        # Target sequences caught up on their last verification (see `catch_up`), and the
        # logits of each one's first draft token [n, vocab].
        self._caught_up: dict[Sequence, _CaughtUp] = {}
        self._caught_up_rows: torch.Tensor | None = None
        self.num_caught_up = 0  # proposals that started from their verification's catch-up

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposals:
        """Drafts on the device: one forward per drafted token, each fed the tokens the step
        before drew there, nothing read back until the engine verifies. A sequence caught up
        on its last verification (`catch_up`) draws its first token from the logits it got
        there, without a forward of its own."""
        ready = self._take_caught_up(seqs)
        self.num_caught_up += len(ready)
        self._learn_drafted()
        n, width = len(seqs), max(num_tokens, default=0)
        drafted = torch.zeros((n, width), dtype=torch.int64, device=self.device)
        counts = [0] * n
        active = [i for i in range(n) if num_tokens[i] > 0]
        shadows = {i: self._shadows[seqs[i]] if i in ready else self._sync(seqs[i]) for i in active}
        want_probs = any(not seqs[i].params.greedy for i in active)
        probs: torch.Tensor | None = None
        in_flight: InFlightTokens | None = None
        budget_left = self.max_step_tokens
        for j in range(width):
            early = [i for i in active if i in ready] if j == 0 else []
            batch = ScheduledBatch()
            for i in active:
                if j == 0 and i in ready:
                    continue
                shadow = shadows[i]
                num_new = min(shadow.num_tokens - shadow.num_computed_tokens, budget_left)
                # Else (over the step's budget, or the draft pool full) it proposes less.
                if num_new > 0 and self.block_manager.allocate(shadow, num_new):
                    batch.seqs.append(shadow)
                    batch.num_new_tokens.append(num_new)
                    budget_left -= num_new
            logits = self.runner.compute_logits(batch, in_flight) if batch.seqs else None
            for shadow, num_new in zip(batch.seqs, batch.num_new_tokens):
                shadow_advance(shadow, num_new)
            # A sequence whose catch-up did not fit this step's budget proposes nothing.
            fresh = [i for i in active if logits is not None and shadows[i] in logits]
            active = early + fresh
            if not active:
                break
            tokens, q = self._draw([seqs[i] for i in active], j, self._first_rows(early, ready, fresh, shadows, logits),
                                   want_probs)
            if active == list(range(n)):
                drafted[:, j] = tokens
            else:
                drafted[:, j].index_copy_(0, on_device(active, torch.int64, self.device), tokens)
            if q is not None:
                if probs is None:
                    probs = torch.zeros((n, width, self.vocab_size), dtype=torch.float32, device=self.device)
                probs[:, j].index_copy_(0, on_device(active, torch.int64, self.device), q)
            for i in active:
                counts[i] += 1
                shadow_append_placeholders(shadows[i])  # learnt after verification
            in_flight = InFlightTokens(tokens, {shadows[i]: r for r, i in enumerate(active)})
            # The last drafted token is not fed: the target computes its KV if it is accepted.
            active = sorted(i for i in active if counts[i] < num_tokens[i])
            budget_left = self.max_step_tokens
        self._caught_up_rows = None
        self._drafted = (drafted, [(shadows[i], i, counts[i]) for i in range(n) if counts[i]])
        return Proposals(drafted, counts, probs)

    def _first_rows(self, early: list[int], ready: dict[int, int], fresh: list[int], shadows: dict[int, Sequence],
                    logits: StepLogits | None) -> torch.Tensor:
        """The logits [len(early) + len(fresh), vocab] a draft step draws from: the caught-up
        sequences' (`early`, from `catch_up`), then those of this step's forward."""
        parts = []
        if early:
            assert self._caught_up_rows is not None
            index = [ready[i] for i in early]
            whole = index == list(range(self._caught_up_rows.shape[0]))
            parts.append(self._caught_up_rows if whole
                         else self._caught_up_rows.index_select(0, on_device(index, torch.int64, self.device)))
        if fresh:
            assert logits is not None
            parts.append(logits.rows_of([shadows[i] for i in fresh]))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def catch_up(self, seqs: list[Sequence], token_ids: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """Feed the draft every position a verification checked, right behind it on the
        device and before the host has read it: `seqs` (each still holding the proposals it
        verified), the tokens the acceptance emitted there (token_ids [m, k + 1]: the kept
        proposals, the target's own, then garbage) and how many proposals it kept
        (num_accepted [m]). The garbage's KV lies past what the draft attends to and is
        overwritten later; the row after the target's own token gives the first token of
        the next proposal. Only sequences the draft proposed for in this pass qualify (their
        shadow's KV covers the target's tokens before the verified ones); under CUDA graphs
        only a batch a graph replays (one verified width), else the next proposal catches up
        as before."""
        self._caught_up.clear()
        self._caught_up_rows = None
        drafted = {shadow: count for shadow, _, count in self._drafted[1]} if self._drafted is not None else {}
        candidates = []
        for i, seq in enumerate(seqs):
            shadow = self._shadows.get(seq)
            if shadow is not None and drafted.get(shadow):
                candidates.append((i, seq, shadow, 1 + len(seq.spec_token_ids)))
        if not candidates:
            return
        graphs = self.runner.graphs
        width = candidates[0][3]
        if graphs is not None and (any(w != width for *_, w in candidates)
                                   or graphs.bucket_for(len(candidates), width) is None):
            return
        batch, picked = ScheduledBatch(), []
        for i, seq, shadow, w in candidates:
            start = seq.num_tokens  # the draft's KV covers the positions before it
            shadow_rewind(shadow, start)
            if not self.block_manager.allocate(shadow, w):  # the next proposal catches up instead
                continue
            shadow_append_placeholders(shadow, w - 1)
            batch.seqs.append(shadow)
            batch.num_new_tokens.append(w)
            picked.append((i, seq, start))
        if not batch.seqs:
            return
        assert self._drafted is not None
        fed = set(batch.seqs)  # their placeholders are the target's tokens now, not drafted ones
        self._drafted = (self._drafted[0], [e for e in self._drafted[1] if e[0] not in fed])
        stride = token_ids.shape[1]
        rows_of = {shadow: i * stride for shadow, (i, _, _) in zip(batch.seqs, picked)}
        logits = self.runner.compute_logits(batch, InFlightTokens(token_ids.reshape(-1), rows_of))
        firsts = []
        for shadow, w, (i, seq, start) in zip(batch.seqs, batch.num_new_tokens, picked):
            shadow_caught_up(shadow, start + w)
            self._caught_up[seq] = _CaughtUp(start, w, len(firsts))
            firsts.append(logits.spans[shadow][0])
        rows = [i for i, _, _ in picked]
        accepted = num_accepted if rows == list(range(len(seqs))) else num_accepted.index_select(
            0, on_device(rows, torch.int64, self.device))
        self._caught_up_rows = logits.values.index_select(0, on_device(firsts, torch.int64, self.device) + accepted)

    def settle(self, seqs: list[Sequence], token_ids: list[list[int]]) -> None:
        """The host's read of the verification that `catch_up` followed: each sequence's
        emitted tokens (all of them its own unless one of them ends it, which releases it).
        A caught-up shadow now holds exactly them."""
        for seq, ids in zip(seqs, token_ids):
            c = self._caught_up.get(seq)
            shadow = self._shadows.get(seq)
            if c is None or shadow is None:
                continue
            assert len(ids) <= c.width
            c.kept = len(ids)
            shadow_rewind(shadow, c.start, ids, c.start + c.kept)
            self.block_manager.trim(shadow, shadow.num_computed_tokens)

    def _take_caught_up(self, seqs: list[Sequence]) -> dict[int, int]:
        """Of `seqs` (by index), those whose catch-up on their last verification still holds
        (no step since gave them tokens), and the row of each one's first draft token in
        `_caught_up_rows`. Clears the rest; a shadow never settled goes back to the KV it
        had before its catch-up."""
        records, self._caught_up = self._caught_up, {}
        ready = {}
        for i, seq in enumerate(seqs):
            c = records.get(seq)
            if c is not None and c.kept is not None and seq.num_tokens == c.start + c.kept:
                ready[i] = c.row
        for seq, c in records.items():
            shadow = self._shadows.get(seq)
            if c.kept is None and shadow is not None:
                shadow_rewind(shadow, c.start)
                self.block_manager.trim(shadow, c.start)
        return ready

    def _draw(self, seqs: list[Sequence], step: int, logits: torch.Tensor, with_probs: bool
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft token `step` of each of `seqs` from the draft's logits [len(seqs), vocab], on
        the device, and the distributions they were drawn from (None: greedy). A seeded
        request's draws are keyed by the output index the token would take, in a stream
        of their own (the target's acceptance must not reuse them). Under a trimmed head the
        distributions are widened to the whole vocabulary, zero past the head's ids."""
        tokens, q = self.sampler.draw(logits, [s.params for s in seqs], [s.next_output_index + step for s in seqs],
                                      with_probs, stream="draft")
        if self._head_ids is not None:
            tokens = self._head_ids[tokens]
        if q is not None and q.shape[1] < self.vocab_size:
            wide = q.new_zeros((q.shape[0], self.vocab_size))
            if self._head_ids is None:
                wide[:, :q.shape[1]] = q
            else:
                wide.index_copy_(1, self._head_ids, q)
            q = wide
        return tokens, q

    def release(self, seq: Sequence) -> None:
        self._caught_up.pop(seq, None)
        shadow = self._shadows.pop(seq, None)
        if shadow is not None:
            self.block_manager.free(shadow)

    def _learn_drafted(self) -> None:
        """The last proposal's tokens into their shadows, in place of the placeholders (one
        read of the device, after the verification step has already read it)."""
        if self._drafted is None:
            return
        drafted, entries = self._drafted
        self._drafted = None
        live = set(self._shadows.values())
        entries = [e for e in entries if e[0] in live]
        if not entries:
            return
        ids = drafted.tolist()
        for shadow, row, count in entries:
            shadow_fill_drafted(shadow, ids[row][:count])

    def _sync(self, seq: Sequence) -> Sequence:
        """The shadow of `seq`, its KV kept only where the draft saw the target's tokens."""
        shadow = self._shadows.get(seq)
        if shadow is None:
            shadow = Sequence(seq.request_id, seq.prompt_token_ids, seq.params, self.block_manager.block_size)
            self._shadows[seq] = shadow
        # Positions past the target's last token, and drafted ones the target
        # replaced, hold KV of rejected guesses. Guesses only ever sit in the last
        # MAX_SPECULATIVE_TOKENS positions, so the scan is short. The target's last two
        # tokens are always recomputed: the last one's logits give the first proposal, and
        # every steady sequence then catches up by exactly two tokens (the last accepted
        # one and the target's own), one shape that a CUDA graph replays.
        valid = min(shadow.num_computed_tokens, seq.num_tokens - 2)
        for pos in range(max(0, valid - MAX_SPECULATIVE_TOKENS), max(valid, 0)):
            if shadow.token_ids[pos] != seq.token_ids[pos]:
                valid = pos
                break
        valid = max(valid, 0)
        shadow_rewind(shadow, valid, seq.token_ids[valid:])
        self.block_manager.trim(shadow, valid)
        return shadow
