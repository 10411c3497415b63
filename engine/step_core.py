"""The engine's step loop: schedule -> run -> sample -> postprocess, one step at a time.

With `SchedulerConfig.async_scheduling` steps overlap: a step is queued on the device (its
sequences advanced as if it had run, each sampled token a placeholder that the next step
reads there), and only then is the step before resolved (its tokens read back and handed
to the scheduler, which places them and applies the stop rules). Around the forward: the
penalties and the grammars' masks on the rows sampled from, prompt log-probabilities
collected, speculation's drafts proposed before the step and verified when it resolves,
the KV tiers filled before the step reads them, and the disaggregation hooks
(`KVHandoff`: landed KV admitted, held KV reported, a finished sequence's blocks held).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.grammar import StructuredOutputs
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.kv_handoff import KVHandoff
from pdserve.engine.outputs import TokenDelta, merge_deltas
from pdserve.engine.penalties import Penalties
from pdserve.engine.prompt_logprobs import PromptChunk, PromptLogprobs
from pdserve.engine.runner.assembly import EngineParts
from pdserve.engine.runner.step_inputs import InFlightTokens
from pdserve.engine.sampler import PendingSample, TokenLogprobs
from pdserve.engine.scheduler import ScheduledBatch, Scheduler
from pdserve.engine.sequence import FinishReason, Sequence
from pdserve.engine.speculative_steps import SpeculativeSteps, StepProposals
from pdserve.engine.speculator import Speculator


@dataclass(slots=True)
class _LaunchedStep:
    """A step whose forward and sampling are queued on the device."""

    batch: ScheduledBatch
    seqs: list[Sequence]  # the sampled sequences, in the rows of `sample`
    rows: dict[Sequence, int]
    sample: PendingSample | None
    verifying: dict[Sequence, torch.Tensor]  # logits [1 + K, vocab] of the sequences that proposed K tokens
    proposals: StepProposals | None = None
    prompt: dict[Sequence, PromptChunk] = field(default_factory=dict)  # prompt log-probabilities computed
    free_after: list[Sequence] = field(default_factory=list)  # finished meanwhile: free once resolved
    batch_seqs: set[Sequence] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.batch_seqs = set(self.batch.seqs)


class EngineCore:
    def __init__(self, config: EngineConfig, parts: EngineParts, scheduler: Scheduler, kv: KVCache,
                 handoff: KVHandoff) -> None:
        self.config = config
        self.runner, self.sampler = parts.runner, parts.sampler
        self._tensor_parallel = parts.ranks is not None
        self.scheduler, self.kv, self.handoff = scheduler, kv, handoff
        self.structured = StructuredOutputs(parts.tokenizer, parts.arch.vocab_size, parts.arch.eos_token_ids)
        self.penalties = Penalties(parts.arch.vocab_size, parts.arch.eos_token_ids, parts.device)
        self.requests: dict[str, Sequence] = {}  # the live ones, by id
        # Requests that asked for prompt log-probabilities, until their first token carries them.
        self._prompt_logprobs: dict[str, PromptLogprobs] = {}
        self._spec: SpeculativeSteps | None = None
        self.in_flight: _LaunchedStep | None = None  # the step queued last, not yet resolved

    # Requests ------------------------------------------------------------

    def add(self, seq: Sequence, hold_kv: bool = False) -> None:
        """Queue `seq` (ValueError, nothing changed, for what this engine cannot serve)."""
        if seq.params.prompt_logprobs is not None:
            if self._tensor_parallel:
                raise ValueError("prompt_logprobs is not supported under tensor parallelism (the other ranks "
                                 "would have to compute the prompt's logits too)")
            self._prompt_logprobs[seq.request_id] = PromptLogprobs(seq.num_prompt_tokens)
        self.requests[seq.request_id] = seq
        if hold_kv:
            self.handoff.hold_when_finished(seq.request_id)
        self.scheduler.add(seq)

    def adopt(self, seq: Sequence) -> None:
        """A sequence the scheduler took in another way (a decode worker's reservation)."""
        self.requests[seq.request_id] = seq

    def abort(self, request_id: str) -> bool:
        """Stop a live request at once and free its blocks; False if it is unknown or done."""
        seq = self.requests.get(request_id)
        if seq is None:
            return False
        self._finish(seq, FinishReason.ABORT)
        return True

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or bool(self.scheduler.landing) or self.in_flight is not None

    def set_speculator(self, speculator: Speculator | None) -> None:
        self._spec = None if speculator is None else SpeculativeSteps(
            speculator, self.scheduler, self.structured, self.penalties, uniform=self.runner.graphs is not None)

    @property
    def speculator(self) -> Speculator | None:
        return None if self._spec is None else self._spec.speculator

    # Stepping ------------------------------------------------------------

    def step(self) -> list[TokenDelta]:
        """Run one iteration; returns a delta for every request that got tokens (`Engine.step`)."""
        deltas: list[TokenDelta] = []
        previous, self.in_flight = self.in_flight, None
        if previous is not None and not self._can_overlap():
            deltas += self._resolve(previous)
            previous = None
        if self.scheduler.landing:
            self.handoff.admit_landed()
        proposals = None
        if self._spec is not None:
            k, decoding = self._spec.plan()
            if k > 0 and previous is not None:  # the drafter reads the tokens of the step before
                deltas += self._resolve(previous)
                previous, decoding = None, None  # (who decodes, afresh)
            if k > 0:
                proposals = self._spec.propose(k, decoding)
        batch = self.scheduler.schedule()
        self.kv.before_step(batch)
        if self._spec is not None:
            for seq in batch.preempted:
                self._spec.release(seq)
        launched = self._launch(batch, proposals, previous) if batch.seqs else None
        overlap = launched is not None and self._can_overlap() and not launched.verifying
        if overlap:
            self.in_flight = launched  # before resolving the previous step: see _finish
        if previous is not None:
            deltas += self._resolve(previous)
        if launched is not None and not overlap:
            deltas += self._resolve(launched)
        return deltas

    def _can_overlap(self) -> bool:
        # A constrained sequence's mask for step N+1 needs step N's token: while one is live,
        # steps do not overlap (each resolves before the next is queued).
        return self.config.scheduler.async_scheduling and not self.structured.has_active

    def _launch(self, batch: ScheduledBatch, proposals: StepProposals | None,
                previous: _LaunchedStep | None) -> _LaunchedStep:
        """Queue the batch's forward and sampling; advance each sequence as if the step had
        run, its sampled token a placeholder until the step resolves. `previous`: the step
        before, still unresolved, whose tokens this one reads on the device; `proposals`:
        this step's draft tokens, which it verifies (read on the device too)."""
        in_flight = None
        if previous is not None and previous.sample is not None:
            in_flight = InFlightTokens(previous.sample.token_ids, previous.rows)
        elif proposals is not None:
            width = proposals.proposals.token_ids.shape[1]
            in_flight = InFlightTokens(proposals.proposals.token_ids.view(-1),
                                       {seq: row * width for seq, row in proposals.rows.items()})
        wanted = [seq for seq in batch.seqs if seq.request_id in self._prompt_logprobs] if self._prompt_logprobs else ()
        logits = self.runner.compute_logits(batch, in_flight, wanted)
        self.handoff.report_kv_computed(batch)
        verifying = {seq: logits.pop(seq) for seq in batch.seqs if seq.spec_token_ids}
        seqs, sample = self.runner.sample_async(logits, self._to_sample)
        if sample is not None:
            self.penalties.record(seqs, sample.token_ids)
        rows = {seq: i for i, seq in enumerate(seqs)}
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            if seq in verifying:
                continue
            self.scheduler.launched(seq, num_new, samples=seq in rows)
            # Now, not at resolve: the next step's admissions must find this one's prefix.
            self.kv.block_manager.cache_full_blocks(seq)
        return _LaunchedStep(batch, seqs, rows, sample, verifying, proposals, logits.prompt)

    def _to_sample(self, seqs: list[Sequence], rows: torch.Tensor) -> torch.Tensor:
        """The logits to sample from: the model's rows [len(seqs), vocab] with penalties and bias
        (a copy; the model's stay for the log-probabilities), then the grammars' masks (on both)."""
        adjusted = self.penalties.adjusted(seqs, rows)
        self.structured.mask_logits(seqs, *((rows,) if adjusted is rows else (rows, adjusted)))
        return adjusted

    # Postprocessing ------------------------------------------------------

    def _resolve(self, launched: _LaunchedStep) -> list[TokenDelta]:
        """Wait for a launched step's tokens and turn them into deltas."""
        out = launched.sample.resolve() if launched.sample is not None else None
        self._free_deferred(launched)
        verified = self._spec.verify(launched.verifying, launched.proposals) if self._spec is not None else {}
        for seq, chunk in launched.prompt.items():
            collecting = self._prompt_logprobs.get(seq.request_id)
            if collecting is not None and not seq.is_finished:
                collecting.add(chunk)
        deltas = []
        for seq in launched.batch.seqs:
            if seq.is_finished:  # finished or aborted while the step ran
                continue
            if seq in launched.verifying:
                deltas.append(self._accept_verified(seq, launched.verifying[seq], verified[seq]))
                continue
            row = launched.rows.get(seq)
            if row is not None:
                assert out is not None
                deltas.append(self._accept_token(seq, out.token_ids[row], out.logprobs[row]))
            self.kv.block_manager.cache_full_blocks(seq)
        return deltas

    def _accept_verified(self, seq: Sequence, logits: torch.Tensor, token_ids: list[int]) -> TokenDelta:
        """Keep the proposed tokens the target accepted, plus one of its own.

        logits: [1 + K, vocab] from this step's pass over the last token and the
        K proposed tokens the scheduler kept (`seq.spec_token_ids`).
        """
        params = seq.params
        self.scheduler.verified(seq, len(token_ids))
        logprobs: list[Any] = (self.sampler.logprobs(logits[:len(token_ids)], token_ids, params)
                               if params.logprobs is not None else [None] * len(token_ids))
        deltas = []
        for token_id, lp in zip(token_ids, logprobs):
            deltas.append(self._accept_token(seq, token_id, lp))
            if seq.is_finished:  # a stop token among the accepted ones: drop the rest
                break
        if not seq.is_finished:
            self.kv.block_manager.trim(seq, seq.num_computed_tokens)
            self.kv.block_manager.cache_full_blocks(seq)
        return merge_deltas(deltas)

    def _accept_token(self, seq: Sequence, token_id: int, logprobs: Any) -> TokenDelta:
        """A sampled token into its sequence (the scheduler places it and applies the stop rules)."""
        prompt_logprobs = self._take_prompt_logprobs(seq)  # before _finish forgets them
        pos, reason = self.scheduler.take_token(seq, token_id)
        if reason is not FinishReason.STOP and self.structured.accept(seq):
            reason = FinishReason.STOP  # the grammar is complete
        if reason is not None:
            self._finish(seq, reason, num_tokens=pos + 1)  # a token sampled after the last one is dropped
        held, draft_state = (), b""
        if seq.request_id in self.scheduler.held:
            held = tuple(seq.block_ids)
            if self.runner.mtp is not None:
                draft_state = self.runner.mtp.export(seq, seq.num_prompt_tokens - 1)
        return TokenDelta(seq.request_id, (token_id,), reason, (logprobs,) if logprobs else (),
                          seq.num_prompt_tokens, seq.num_cached_tokens, held, prompt_logprobs, draft_state)

    def _take_prompt_logprobs(self, seq: Sequence) -> tuple[TokenLogprobs | None, ...]:
        """A request's prompt log-probabilities, for the delta of its first token (then forgotten)."""
        collecting = self._prompt_logprobs.get(seq.request_id)
        if collecting is None or not collecting.complete:
            return ()
        del self._prompt_logprobs[seq.request_id]
        return tuple(collecting.entries)

    def _finish(self, seq: Sequence, reason: FinishReason, num_tokens: int | None = None) -> None:
        del self.requests[seq.request_id]
        self._prompt_logprobs.pop(seq.request_id, None)
        hold = self.handoff.finishing(seq, reason)
        # A step still running writes this sequence's KV: its blocks go back to the pool
        # once that step has resolved, so that no other writer (a KV transfer) gets them first.
        in_flight = self.in_flight is not None and seq in self.in_flight.batch_seqs
        self.scheduler.finish(seq, reason, free_blocks=not in_flight, hold=hold, num_tokens=num_tokens)
        if in_flight and not hold:
            self.in_flight.free_after.append(seq)
        self.structured.release(seq)
        self.penalties.release(seq)
        if self._spec is not None:
            self._spec.release(seq)

    def _free_deferred(self, launched: _LaunchedStep) -> None:
        for seq in launched.free_after:
            self.kv.block_manager.free(seq)
        launched.free_after.clear()

