"""The offline engine: add requests, step, read token deltas.

One process, one model, one KV pool. Prefill and decode workers wrap the same
pieces; this class is what `pdserve generate` and the tests drive directly. It is a
façade: it validates the requests it is given (`add_request`, `generate`: the request
processor, where the offline API's requests enter) and turns deltas into text, and takes
the workers' `WorkerRequest`s, which a frontend validated, on an integrity check alone
(`add_worker_request`, `reserve`); the step loop is `EngineCore` (step_core.py), the KV
cache with its tiers and events `KVCache` (kv_cache.py), and the disaggregated states
`KVHandoff` (kv_handoff.py).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterator

import torch

from pdserve.engine.config import EngineConfig, SpecConfig
from pdserve.engine.kv.events import DISK_TIER, HOST_TIER, KVSnapshot
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.kv_handoff import KVComputed, KVHandoff
from pdserve.engine.messages import WorkerRequest
from pdserve.engine.outputs import EngineLoad, RequestOutput, TextDelta, TokenDelta
from pdserve.engine.runner.assembly import assemble
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Sequence
from pdserve.engine.speculative.drafter import Drafter
from pdserve.engine.speculative.factory import build_speculator
from pdserve.engine.speculator import Speculator
from pdserve.engine.step_core import EngineCore
from pdserve.engine.text.request_processor import ProcessedRequest, RequestProcessor

Prompt = str | list[int]


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
        self.kv = KVCache(config, self.pool, self.model_digest)
        self.kv_events, self.kv_tiers, self.block_manager = self.kv.events, self.kv.tiers, self.kv.block_manager
        if self.kv_tiers is not None:
            self._close_tiers = weakref.finalize(self, self.kv_tiers.close)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len,
                                   frozenset(self.arch.eos_token_ids))
        self.handoff = KVHandoff(config, self.scheduler, self.kv, self.device)
        self.core = EngineCore(config, parts, self.scheduler, self.kv, self.handoff)
        self.structured, self.penalties = self.core.structured, self.core.penalties
        self._ids = itertools.count()
        self.parts = parts
        self.speculate(config.spec)

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
        request = self.processor.process(prompt, params=params)
        _check_prior(num_prior_output_tokens, request)
        return self._add(request.for_worker(self._request_id(request_id), num_prior_output_tokens), hold_kv)

    def add_worker_request(self, req: WorkerRequest, hold_kv: bool = False) -> str:
        """Queue a request that a frontend validated (`RequestProcessor.process`): a worker's
        way in. Only its integrity is checked (`WorkerRequest.check`: BadWorkerRequest, a
        ValueError); `hold_kv` as in `add_request`."""
        self._check(req)
        return self._add(req, hold_kv)

    def _check(self, req: WorkerRequest) -> None:
        req.check(self.arch.vocab_size, self.max_model_len, self.tokenizer is not None)

    def _request_id(self, request_id: str | None) -> str:
        return request_id if request_id is not None else f"req-{next(self._ids)}"

    def _add(self, req: WorkerRequest, hold_kv: bool = False) -> str:
        self._check_unused(req.request_id)
        self.core.add(self._sequence(req), hold_kv)
        return req.request_id

    def _check_unused(self, request_id: str) -> None:
        if request_id in self.core.requests:
            raise ValueError(f"request id {request_id!r} is already in use")

    def _sequence(self, req: WorkerRequest) -> Sequence:
        return Sequence(req.request_id, req.prompt_token_ids, req.params, self.pool.layout.block_size,
                        num_prior_output_tokens=req.num_prior_output_tokens)

    def abort(self, request_id: str) -> bool:
        """Stop a request at once and free its blocks (held ones too); False if it is unknown or done."""
        return self.release(request_id) or self.core.abort(request_id)

    # Disaggregation: a prefill worker holds finished KV until it is sent; a
    # decode worker reserves blocks, receives the KV, then admits the sequence.

    def release(self, request_id: str) -> bool:
        """Free a held request's blocks (full ones stay in the prefix cache)."""
        return self.handoff.release(request_id)

    def reserve(self, req: WorkerRequest) -> list[int]:
        """Allocate blocks for the prompt of `req` (a frontend validated it: only its integrity
        is checked, as by `add_worker_request`), whose KV another worker will write.

        Returns the block ids (in position order). Raises ValueError (BadWorkerRequest, or an
        id in use) and NoCapacity when seats or blocks are short. Under the priority policy a
        request may take the seat of a running one of lower priority, which the next step preempts.
        """
        self._check(req)
        self._check_unused(req.request_id)
        self.handoff.check_seat(req.params.priority, req.params.tenant, req.params.tenant_weight)
        seq = self._sequence(req)
        block_ids = self.handoff.reserve(seq)
        self.core.adopt(seq)
        return block_ids

    def admit_prefilled(self, request_id: str, first_token_id: int, kv_ready: torch.cuda.Event | None = None,
                        grammar: str | None = None, draft_state: bytes = b"") -> None:
        """The reserved blocks hold the prompt's KV: decode from `first_token_id` on.

        `kv_ready`: the KV is still being copied in and is there once this CUDA event has
        completed. The sequence waits outside the batch until then, so that no step (and no
        other sequence) waits for the copy.
        `grammar`: the request's compiled grammar as its prefill worker serialized it
        (`StructuredOutputs.export`), taken into this engine's cache instead of compiling it again.
        `draft_state`: the prefill worker's `TokenDelta.held_draft_state` (an MTP drafter's start:
        the hidden state at the last prompt token); b"": none (its first drafts may be worse).
        """
        seq = self.core.requests.get(request_id)
        if seq is None:
            raise ValueError(f"request {request_id!r} is not waiting for its KV")
        if draft_state and self.runner.mtp is not None:
            self.runner.mtp.adopt(seq, seq.num_prompt_tokens - 1, draft_state)
        if grammar is not None and seq.params.structured is not None:
            self.structured.adopt(seq.params.structured, grammar)
        self.handoff.land(seq, first_token_id, kv_ready)

    def set_kv_computed_callback(self, callback: KVComputed | None) -> None:
        """Call `callback(request_id, block_ids, event)` from the step that computes the last
        of a `hold_kv` request's prompt, right after its forward is queued and before the
        sampling waits for it: `event` (CUDA; None on the CPU, where the KV is complete)
        completes once the KV is in `block_ids`. Lets a prefill worker queue the KV's transfer
        while the GPU still computes. Runs on the engine's thread: it must return at once."""
        self.handoff.set_kv_computed_callback(callback)

    # What the router reads -----------------------------------------------

    def load(self) -> EngineLoad:
        sched, bm = self.scheduler, self.block_manager
        self.kv.record_tier_events()
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
            preemptions_by=tuple((t, p, n) for (t, p), n in sched.preemptions_by.items()),
            prompt_tokens_computed=sched.num_prompt_tokens_computed,
            spec=self.speculator.metrics.snapshot() if self.speculator is not None else None,
            kv_tiers=self.kv_tiers.stats() if self.kv_tiers is not None else None,
            kv_layout=self.kv_wire_layout.kind,
            kv_bytes_per_token=self.kv_wire_layout.bytes_per_token,
        )

    def kv_snapshot(self) -> KVSnapshot:
        """Every block the prefix cache and the tiers below hold now, as of the KV events recorded so far."""
        return self.kv.snapshot()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (`BlockManager.reset_prefix_cache`); False while
        a request holds blocks. The tiers below keep theirs (`wipe_kv_tiers`)."""
        return self.block_manager.reset_prefix_cache()

    def wipe_kv_tiers(self, tiers: tuple[str, ...] = (HOST_TIER, DISK_TIER)) -> bool:
        """Drop every block of the host and/or disk tier (their files too); False without tiers."""
        return self.kv.wipe_tiers(tiers)

    # Stepping ------------------------------------------------------------

    @property
    def has_unfinished(self) -> bool:
        return self.core.has_unfinished

    def speculate(self, spec: SpecConfig | None, drafter: Drafter | None = None) -> None:
        """Speculate as `spec` says from the next step on (None, or a config with speculation
        off: plain steps), through the builder `Engine(config)` uses for `config.spec`
        (`speculative.factory.build_speculator`). `drafter` replaces the drafter `spec` names:
        a benchmark's or a test's own, adapted and verified as any other. Raises ValueError for
        a draft that cannot serve this model."""
        speculator = None if spec is None else build_speculator(self.parts, self.config, spec, drafter)
        self.core.set_speculator(speculator)

    @property
    def speculator(self) -> Speculator | None:
        return self.core.speculator

    def step(self) -> list[TokenDelta]:
        """Run one iteration; returns a delta for every request that got tokens.

        With `SchedulerConfig.async_scheduling` steps overlap: this call queues the next step
        on the GPU first, and only then waits for the previous one's tokens and returns their
        deltas, so the host's work runs while the GPU computes. A speculative step does not
        overlap (its proposals need the tokens before it); a step at K = 0 (the speculator's
        `plan`, e.g. adaptive K at a large batch) is a plain one and does.
        """
        return self.core.step()

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
        return [(self._add(request.for_worker(self._request_id(None))), request) for request in requests]

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


def _check_prior(num_prior_output_tokens: int, request: ProcessedRequest) -> None:
    if not 0 <= num_prior_output_tokens <= len(request.prompt_token_ids):
        raise ValueError(f"num_prior_output_tokens must be in [0, {len(request.prompt_token_ids)}] (the prompt's "
                         f"length), got {num_prior_output_tokens}")
