"""The offline engine: add requests, step, read token deltas.

One process, one model, one KV pool. Prefill and decode workers wrap the same
pieces; this class is what `pdserve generate` and the tests drive directly.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from pdserve.engine.assembly import assemble
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import EngineConfig
from pdserve.engine.grammar import StructuredOutputs
from pdserve.engine.kv_events import DEVICE_TIER, DISK_TIER, HOST_TIER, KVEventRecorder, KVSnapshot
from pdserve.engine.kv_tiers import KVTiers, TierHit
from pdserve.engine.outputs import EngineLoad, RequestOutput, TextDelta, TokenDelta
from pdserve.engine.penalties import Penalties
from pdserve.engine.prompt_logprobs import PromptChunk, PromptLogprobs
from pdserve.engine.request_processor import ProcessedRequest, RequestProcessor
from pdserve.engine.sampler import PendingSample, TokenLogprobs
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.scheduler import ScheduledBatch, Scheduler
from pdserve.engine.sequence import FinishReason, Sequence
from pdserve.engine.spec_step import SpeculativeSteps, StepProposals
from pdserve.engine.speculator import Speculator
from pdserve.engine.step_inputs import InFlightTokens

logger = logging.getLogger(__name__)

Prompt = str | list[int]


@dataclass(slots=True)
class _Request:
    seq: Sequence
    hold_kv: bool = False  # keep the blocks after finishing, until release()


# (request_id, block_ids, event): a hold_kv request's prompt KV is computed, or will be once
# the CUDA event completes (None: now). See Engine.set_kv_computed_callback.
KVComputed = Callable[[str, tuple[int, ...], "torch.cuda.Event | None"], None]


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


class NoCapacity(RuntimeError):
    """The pool cannot hold a request right now (retry later or elsewhere)."""


class Engine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        parts = assemble(config)
        self.model_name, self.arch, self.tokenizer = parts.model_name, parts.arch, parts.tokenizer
        self.model_digest = parts.model_digest
        self.device, self.dtype = parts.device, parts.dtype
        self.model, self.pool, self.runner, self.sampler = parts.model, parts.pool, parts.runner, parts.sampler
        self.ranks = parts.ranks
        if self.ranks is not None:
            self._stop_ranks = weakref.finalize(self, self.ranks.close)
        self.kv_shards, self.kv_wire_layout = parts.kv_shards, parts.kv_wire_layout
        self.max_model_len = parts.max_model_len
        self.processor = RequestProcessor(self.tokenizer, self.model_name, self.arch.vocab_size, self.max_model_len)
        # What the prefix cache stored and evicted, for the router (taken with each load report).
        self.kv_events = KVEventRecorder(config.cache.kv_events_max_pending)
        # Host memory and disk below the pool (None: neither configured).
        self.kv_tiers = KVTiers(config.kv_tiers, self.pool, self.model_digest) if config.kv_tiers.enabled else None
        if self.kv_tiers is not None:
            self._close_tiers = weakref.finalize(self, self.kv_tiers.close)
        self.block_manager = BlockManager(self.pool.num_blocks, self.pool.layout.block_size,
                                          config.cache.enable_prefix_caching, self.kv_events, self.kv_tiers)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len,
                                   frozenset(self.arch.eos_token_ids))
        self._spec: SpeculativeSteps | None = None
        self.structured = StructuredOutputs(self.tokenizer, self.arch.vocab_size, self.arch.eos_token_ids)
        self.penalties = Penalties(self.arch.vocab_size, self.arch.eos_token_ids, self.device)
        self._requests: dict[str, _Request] = {}
        # Requests that asked for prompt log-probabilities, until their first token carries them.
        self._prompt_logprobs: dict[str, PromptLogprobs] = {}
        self._on_kv_computed: KVComputed | None = None
        self._in_flight: _LaunchedStep | None = None  # the step queued last, not yet resolved
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's other tensor-parallel ranks and its KV tiers' offload thread
        (idempotent; also done when the engine is garbage-collected)."""
        if self.ranks is not None:
            self._stop_ranks()  # the finalizer's own call: runs once, however often close() is
        if self.kv_tiers is not None:
            self._close_tiers()

    # Requests ------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> list[int]:
        return self.processor.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return self.processor.apply_chat_template(messages)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    hold_kv: bool = False, num_prior_output_tokens: int = 0) -> str:
        """Queue a request; raises ValueError (and changes nothing) if it is invalid.

        The engine emits token ids only, so it refuses stop strings (ValueError): text and
        stop strings are the request processor's, which `generate`/`generate_stream` and the
        frontends put in front (`self.processor`).
        hold_kv: when the request finishes, keep its blocks (their ids come with the last
                delta, `TokenDelta.held_block_ids`)
        until `release`: a prefill worker ships them to a decode worker first.
        num_prior_output_tokens: the prompt ends with this many tokens that an earlier run of
                the request generated (it continues from them: a migrated request), so
                that a seeded request draws what that run would have drawn next.
        """
        if params is not None and params.stop:
            raise ValueError("stop strings are checked on text, which the engine does not make: use generate() or "
                             "generate_stream(), or engine.processor.output_stream() over the deltas")
        return self._add(self.processor.process(prompt, params=params), request_id, hold_kv, num_prior_output_tokens)

    def _add(self, request: ProcessedRequest, request_id: str | None, hold_kv: bool = False,
             num_prior_output_tokens: int = 0) -> str:
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, request.prompt_token_ids, request.params, self.pool.layout.block_size,
                       num_prior_output_tokens=_checked_prior(num_prior_output_tokens, request))
        if request.params.prompt_logprobs is not None:
            if self.ranks is not None:
                raise ValueError("prompt_logprobs is not supported under tensor parallelism (the other ranks "
                                 "would have to compute the prompt's logits too)")
            self._prompt_logprobs[request_id] = PromptLogprobs(seq.num_prompt_tokens)
        self._requests[request_id] = _Request(seq, hold_kv)
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request at once and free its blocks (held ones too); False if it is unknown or done."""
        if self.release(request_id):
            return True
        req = self._requests.get(request_id)
        if req is None:
            return False
        self._finish(req.seq, FinishReason.ABORT)
        return True

    # Disaggregation: a prefill worker holds finished KV until it is sent; a
    # decode worker reserves blocks, receives the KV, then admits the sequence.

    def release(self, request_id: str) -> bool:
        """Free a held request's blocks (full ones stay in the prefix cache)."""
        return self.scheduler.release(request_id)

    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                num_prior_output_tokens: int = 0) -> list[int]:
        """Allocate blocks for a prompt whose KV another worker will write
        (`num_prior_output_tokens`: as in `add_request`).

        Returns the block ids (in position order). Raises ValueError for an
        invalid request and NoCapacity when seats or blocks are short.
        """
        request = self.processor.process(prompt_token_ids, params=params)
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        sched = self.scheduler
        if sched.num_seats_taken >= self.config.scheduler.max_num_seqs:
            raise NoCapacity(f"all {self.config.scheduler.max_num_seqs} sequence slots are taken")
        seq = Sequence(request_id, request.prompt_token_ids, request.params, self.pool.layout.block_size,
                       num_prior_output_tokens=_checked_prior(num_prior_output_tokens, request))
        if self.block_manager.num_blocks_needed(seq, seq.num_tokens) > sched.num_reservable_blocks \
                or not self.block_manager.allocate(seq, seq.num_tokens):
            raise NoCapacity(f"not enough free KV blocks for {seq.num_tokens} tokens")
        self._offload_evicted(wait=True)  # another worker writes these blocks, outside our stream
        self._requests[request_id] = _Request(seq)
        sched.receive(seq)
        return list(seq.block_ids)

    def admit_prefilled(self, request_id: str, first_token_id: int, kv_ready: torch.cuda.Event | None = None) -> None:
        """The reserved blocks hold the prompt's KV: decode from `first_token_id` on.

        `kv_ready`: the KV is still being copied in and is there once this CUDA event has
        completed. The sequence waits outside the batch until then, so that no step (and no
        other sequence) waits for the copy.
        """
        request = self._requests.get(request_id)
        if request is None:
            raise ValueError(f"request {request_id!r} is not waiting for its KV")
        self.scheduler.land(request.seq, first_token_id, kv_ready)

    def _admit_landed(self) -> None:
        """Run the sequences whose KV has landed; with nothing else to run, wait for one
        (bounded) rather than spin."""
        if not self.scheduler.has_unfinished:
            _wait_for_copy(self.scheduler.landing[0], self.config.cache.kv_copy_wait_s)
        self.scheduler.admit_landed()

    def load(self) -> EngineLoad:
        sched, bm = self.scheduler, self.block_manager
        self._record_tier_events()
        return EngineLoad(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_receiving=len(sched.receiving),
            num_held=len(sched.held),
            queued_prefill_tokens=sum(s.num_tokens - s.num_computed_tokens for s in sched.waiting)
            + sum(s.num_tokens - s.num_computed_tokens - 1 for s in sched.running),
            num_free_blocks=bm.num_free_blocks,
            num_blocks=bm.num_blocks,
            num_reservable_blocks=sched.num_reservable_blocks,
            prefix_queried_tokens=bm.num_prefix_queries,
            prefix_hit_tokens=bm.num_prefix_hits,
            num_preemptions=sched.num_preemptions,
            prompt_tokens_computed=sched.num_prompt_tokens_computed,
            spec=self.speculator.metrics.snapshot() if self.speculator is not None else None,
            kv_tiers=self.kv_tiers.stats() if self.kv_tiers is not None else None,
        )

    def kv_snapshot(self) -> KVSnapshot:
        """Every block the prefix cache and the tiers below hold now, as of the KV events recorded so far."""
        hashes = {DEVICE_TIER: self.block_manager.cached_hashes()}
        if self.kv_tiers is not None:
            events, tier_hashes = self.kv_tiers.snapshot()
            self.kv_events.record(events)
            hashes.update(tier_hashes)
        return self.kv_events.snapshot(hashes)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (`BlockManager.reset_prefix_cache`); False while
        a request holds blocks. The tiers below keep theirs (`wipe_kv_tiers`)."""
        return self.block_manager.reset_prefix_cache()

    def wipe_kv_tiers(self, tiers: tuple[str, ...] = (HOST_TIER, DISK_TIER)) -> bool:
        """Drop every block of the host and/or disk tier (their files too); False without tiers."""
        if self.kv_tiers is None:
            return False
        self.kv_tiers.wipe(tiers)
        self._record_tier_events()
        return True

    def _record_tier_events(self) -> None:
        """The tiers' events (mostly made on their offload thread) into the recorder, on this thread."""
        if self.kv_tiers is not None:
            self.kv_events.record(self.kv_tiers.take_events())

    def _offload_evicted(self, wait: bool = False) -> None:
        """Copy the blocks the last allocations evicted down to the tiers, before anyone writes them."""
        if self.kv_tiers is not None:
            self.kv_tiers.offload(self.block_manager.take_evicted(), wait)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or bool(self.scheduler.landing) or self._in_flight is not None

    # Stepping ------------------------------------------------------------

    def set_speculator(self, speculator: Speculator | None) -> None:
        """Speculate with `speculator` from the next step on (None: stop).
        `engine.speculative.build_speculator` makes one from `config.spec`."""
        self._spec = None if speculator is None else SpeculativeSteps(
            speculator, self.scheduler, self.structured, self.penalties, uniform=self.runner.graphs is not None)

    @property
    def speculator(self) -> Speculator | None:
        return None if self._spec is None else self._spec.speculator

    def set_kv_computed_callback(self, callback: KVComputed | None) -> None:
        """Call `callback(request_id, block_ids, event)` from the step that computes the last
        of a `hold_kv` request's prompt, right after its forward is queued and before the
        sampling waits for it: `event` (CUDA; None on the CPU, where the KV is complete)
        completes once the KV is in `block_ids`. Lets a prefill worker queue the KV's transfer
        while the GPU still computes. Runs on the engine's thread: it must return at once."""
        self._on_kv_computed = callback

    def step(self) -> list[TokenDelta]:
        """Run one iteration; returns a delta for every request that got tokens.

        With `SchedulerConfig.async_scheduling` steps overlap: this call queues the next step
        on the GPU first, and only then waits for the previous one's tokens and returns their
        deltas, so the host's work runs while the GPU computes. A speculative step does not
        overlap (its proposals need the tokens before it); a step at K = 0 (the speculator's
        `plan`, e.g. adaptive K at a large batch) is a plain one and does.
        """
        deltas: list[TokenDelta] = []
        previous, self._in_flight = self._in_flight, None
        if previous is not None and not self._can_overlap():
            deltas += self._resolve(previous)
            previous = None
        if self.scheduler.landing:
            self._admit_landed()
        proposals = None
        if self._spec is not None:
            k, decoding = self._spec.plan()
            if k > 0 and previous is not None:  # the drafter reads the tokens of the step before
                deltas += self._resolve(previous)
                previous, decoding = None, None  # (who decodes, afresh)
            if k > 0:
                proposals = self._spec.propose(k, decoding)
        batch = self.scheduler.schedule()
        if self.kv_tiers is not None:
            self._offload_evicted()  # first: an onboarded block may reuse an evicted one
            self.kv_tiers.onboard(cast(list[tuple[int, TierHit]], batch.onboard))
            self._record_tier_events()
        if self._spec is not None:
            for seq in batch.preempted:
                self._spec.release(seq)
        launched = self._launch(batch, proposals, previous) if batch.seqs else None
        overlap = launched is not None and self._can_overlap() and not launched.verifying
        if overlap:
            self._in_flight = launched  # before resolving the previous step: see _finish
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
        if self._on_kv_computed is not None:
            self._report_kv_computed(batch, self._on_kv_computed)
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
            self.block_manager.cache_full_blocks(seq)
        return _LaunchedStep(batch, seqs, rows, sample, verifying, proposals, logits.prompt)

    def _to_sample(self, seqs: list[Sequence], rows: torch.Tensor) -> torch.Tensor:
        """The logits to sample from: the model's rows [len(seqs), vocab] with penalties and bias
        (a copy; the model's stay for the log-probabilities), then the grammars' masks (on both)."""
        adjusted = self.penalties.adjusted(seqs, rows)
        self.structured.mask_logits(seqs, *((rows,) if adjusted is rows else (rows, adjusted)))
        return adjusted

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
            self.block_manager.cache_full_blocks(seq)
        return deltas

    def _report_kv_computed(self, batch: ScheduledBatch, callback: KVComputed) -> None:
        done = [seq for seq, num_new in zip(batch.seqs, batch.num_new_tokens)
                if self._requests[seq.request_id].hold_kv
                and seq.num_computed_tokens < seq.num_prompt_tokens <= seq.num_computed_tokens + num_new]
        if not done:
            return
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        for seq in done:
            callback(seq.request_id, tuple(seq.block_ids), event)

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
            self.block_manager.trim(seq, seq.num_computed_tokens)
            self.block_manager.cache_full_blocks(seq)
        return _merge_deltas(deltas)

    def _accept_token(self, seq: Sequence, token_id: int, logprobs: Any) -> TokenDelta:
        """A sampled token into its sequence (the scheduler places it and applies the stop rules)."""
        prompt_logprobs = self._take_prompt_logprobs(seq)  # before _finish forgets them
        pos, reason = self.scheduler.take_token(seq, token_id)
        if reason is not FinishReason.STOP and self.structured.accept(seq):
            reason = FinishReason.STOP  # the grammar is complete
        if reason is not None:
            self._finish(seq, reason, num_tokens=pos + 1)  # a token sampled after the last one is dropped
        held = tuple(seq.block_ids) if seq.request_id in self.scheduler.held else ()
        return TokenDelta(seq.request_id, (token_id,), reason, (logprobs,) if logprobs else (),
                          seq.num_prompt_tokens, seq.num_cached_tokens, held, prompt_logprobs)

    def _take_prompt_logprobs(self, seq: Sequence) -> tuple[TokenLogprobs | None, ...]:
        """A request's prompt log-probabilities, for the delta of its first token (then forgotten)."""
        collecting = self._prompt_logprobs.get(seq.request_id)
        if collecting is None or not collecting.complete:
            return ()
        del self._prompt_logprobs[seq.request_id]
        return tuple(collecting.entries)

    def _finish(self, seq: Sequence, reason: FinishReason, num_tokens: int | None = None) -> None:
        req = self._requests.pop(seq.request_id)
        self._prompt_logprobs.pop(seq.request_id, None)
        copy = self.scheduler.pending_copy(seq)
        wait_s = self.config.cache.kv_copy_wait_s
        if copy is not None and not _wait_for_copy(copy, wait_s):  # free the blocks after the copy into them
            logger.warning("KV copy into request %s's blocks not done after %.0f s: freeing them anyway",
                           seq.request_id, wait_s)
        hold = req.hold_kv and reason is not FinishReason.ABORT
        # A step still running writes this sequence's KV: its blocks go back to the pool
        # once that step has resolved, so that no other writer (a KV transfer) gets them first.
        in_flight = self._in_flight is not None and seq in self._in_flight.batch_seqs
        self.scheduler.finish(seq, reason, free_blocks=not in_flight, hold=hold, num_tokens=num_tokens)
        if in_flight and not hold:
            self._in_flight.free_after.append(seq)
        self.structured.release(seq)
        self.penalties.release(seq)
        if self._spec is not None:
            self._spec.release(seq)

    def _free_deferred(self, launched: _LaunchedStep) -> None:
        for seq in launched.free_after:
            self.block_manager.free(seq)
        launched.free_after.clear()

    # Offline batch API ---------------------------------------------------

    def generate_stream(self, prompts: list[Prompt], params: SamplingParams | list[SamplingParams] | None = None
                        ) -> Iterator[TextDelta]:
        """Run `prompts` to completion, yielding text deltas as they come.

        Every prompt is validated (ValueError) before any is queued. Closing
        the iterator early aborts what is still running.
        """
        return self._stream(self._submit(prompts, params))

    def generate(self, prompts: list[Prompt], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run `prompts` to completion; one output per prompt, in order."""
        submitted = self._submit(prompts, params)
        outputs = {rid: RequestOutput(rid, request.prompt_token_ids) for rid, request in submitted}
        for delta in self._stream(submitted):
            outputs[delta.request_id].add(delta)
        return list(outputs.values())

    def _submit(self, prompts: list[Prompt], params: SamplingParams | list[SamplingParams] | None
                ) -> list[tuple[str, ProcessedRequest]]:
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        requests = [self.processor.process(p, params=sp) for p, sp in zip(prompts, params_list)]
        return [(self._add(request, None), request) for request in requests]

    def _stream(self, submitted: list[tuple[str, ProcessedRequest]]) -> Iterator[TextDelta]:
        """Step until every submitted request is done, their token deltas turned into text."""
        streams = {rid: self.processor.output_stream(request) for rid, request in submitted}
        try:
            while streams:
                for delta in self.step():
                    stream = streams.get(delta.request_id)
                    if stream is None:
                        continue
                    out = stream.add(delta)
                    if out.finished:
                        del streams[delta.request_id]
                        if not delta.finished:  # a stop string: the engine would go on
                            self.abort(delta.request_id)
                    yield out
        finally:
            for rid in streams:
                self.abort(rid)


def _checked_prior(num_prior_output_tokens: int, request: ProcessedRequest) -> int:
    if not 0 <= num_prior_output_tokens <= len(request.prompt_token_ids):
        raise ValueError(f"num_prior_output_tokens must be in [0, {len(request.prompt_token_ids)}] (the prompt's "
                         f"length), got {num_prior_output_tokens}")
    return num_prior_output_tokens


def _wait_for_copy(event: torch.cuda.Event, timeout_s: float) -> bool:
    """`event.synchronize()`, bounded by `timeout_s` (CUDA offers no timeout, so a helper
    thread waits); whether the copy completed."""
    if event.query():
        return True
    waiter = threading.Thread(target=event.synchronize, name="kv-copy-wait", daemon=True)
    waiter.start()
    waiter.join(timeout_s)
    return not waiter.is_alive()


def _merge_deltas(deltas: list[TokenDelta]) -> TokenDelta:
    """One delta for the tokens a request got in one step (several when speculating)."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    return TokenDelta(last.request_id, tuple(t for d in deltas for t in d.token_ids), last.finish_reason,
                      tuple(lp for d in deltas for lp in d.logprobs), last.num_prompt_tokens, last.num_cached_tokens,
                      last.held_block_ids, deltas[0].prompt_logprobs)
