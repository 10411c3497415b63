"""The offline engine: add requests, step, read token deltas.

One process, one model, one KV pool. Prefill and decode workers wrap the same
pieces; this class is what `pdserve generate` and the tests drive directly.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from engine.attention import backend_for
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs
from engine.detokenizer import IncrementalDetokenizer
from engine.kv_pool import KVLayout, KVPool
from engine.model_runner import ModelRunner
from engine.outputs import EngineLoad, RequestOutput, TokenDelta
from engine.sampler import Sampler
from engine.sampling import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import FinishReason, Sequence, SequenceStatus
from engine.speculator import Proposal, Speculator
from engine.weights import load_model, load_tokenizer, resolve_model

logger = logging.getLogger(__name__)

# Bound on waiting for a KV copy into this engine's blocks (its event): one from a process
# that died may never complete, and the engine thread must keep serving.
COPY_WAIT_S = 10.0

Prompt = str | list[int]


@dataclass(slots=True)
class _Request:
    seq: Sequence
    detokenizer: IncrementalDetokenizer | None
    hold_kv: bool = False  # keep the blocks after finishing, until release()


# (request_id, block_ids, event): a hold_kv request's prompt KV is computed, or will be once
# the CUDA event completes (None: now). See Engine.set_kv_computed_callback.
KVComputed = Callable[[str, tuple[int, ...], "torch.cuda.Event | None"], None]


class NoCapacity(RuntimeError):
    """The pool cannot hold a request right now (retry later or elsewhere)."""


class Engine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        files = resolve_model(config.model)
        self.model_name = files.name
        self.arch = arch = files.arch
        self.device = device = config.model.torch_device()
        self.dtype = dtype = config.model.torch_dtype()
        self.tokenizer = load_tokenizer(files)

        limit = config.model.max_model_len or arch.max_position_embeddings
        if limit > arch.max_position_embeddings:
            raise ValueError(f"max_model_len {limit} exceeds the model's context ({arch.max_position_embeddings})")
        self.model = load_model(files, limit, device, dtype, config.model.seed)

        layout = KVLayout(self.model_name, dtype, arch.num_layers, arch.num_kv_heads, arch.head_dim,
                          config.cache.block_size)
        num_blocks = config.cache.num_blocks or _blocks_that_fit(config, layout, device)
        self.pool = KVPool(layout, num_blocks, device)
        capacity = num_blocks * layout.block_size
        if config.model.max_model_len is not None and capacity < limit:
            raise ValueError(f"max_model_len {limit} needs {limit} KV slots; the pool has {capacity}")
        self.max_model_len = min(limit, capacity)
        self.block_manager = BlockManager(num_blocks, layout.block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.sampler = Sampler(config.model.seed, device)
        backend = backend_for(device)
        graphs = None
        if device.type == "cuda" and not config.model.enforce_eager:
            graphs = DecodeGraphs(self.model, self.pool, backend, arch.head_dim ** -0.5,
                                  config.scheduler.max_num_seqs, self.max_model_len)
            graphs.capture()
        self.runner = ModelRunner(self.model, self.pool, backend, self.sampler, graphs)
        self.speculator: Speculator | None = None
        self._requests: dict[str, _Request] = {}
        self._held: dict[str, Sequence] = {}
        self._num_receiving = 0
        self._on_kv_computed: KVComputed | None = None
        # Admitted, but their KV is still being copied in: (first token, CUDA event of the copy).
        self._kv_landing: dict[Sequence, tuple[int, torch.cuda.Event]] = {}
        self._ids = itertools.count()
        logger.info("engine ready: %s on %s (%s), %d KV blocks of %d tokens, max_model_len %d",
                    self.model_name, device, dtype, num_blocks, layout.block_size, self.max_model_len)

    # Requests ------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"model {self.model_name} has no tokenizer: pass token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"model {self.model_name} has no chat template")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    hold_kv: bool = False) -> str:
        """Queue a request; raises ValueError (and changes nothing) if it is invalid.

        hold_kv: when the request finishes, keep its blocks (their ids come with the last
                delta, `TokenDelta.held_block_ids`)
        until `release`: a prefill worker ships them to a decode worker first.
        """
        params = params or SamplingParams()
        token_ids = self.tokenize(prompt)
        self._validate(token_ids, params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, tuple(token_ids), params, self.pool.layout.block_size)
        detok = IncrementalDetokenizer(self.tokenizer, token_ids, params.stop) if self.tokenizer else None
        self._requests[request_id] = _Request(seq, detok, hold_kv)
        self.scheduler.add(seq)
        return request_id

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens; the context is {self.max_model_len} "
                             f"(prompt plus at least one new token)")
        vocab = self.arch.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:4]} are outside the vocabulary [0, {vocab})")
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"unknown stop token ids {bad} (vocabulary size {vocab})")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop strings need a tokenizer; model {self.model_name} has none")

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
        seq = self._held.pop(request_id, None)
        if seq is None:
            return False
        self.block_manager.free(seq)
        return True

    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        """Allocate blocks for a prompt whose KV another worker will write.

        Returns the block ids (in position order). Raises ValueError for an
        invalid request and NoCapacity when seats or blocks are short.
        """
        self._validate(prompt_token_ids, params)
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        sched = self.scheduler
        if len(sched.running) + self._num_receiving >= self.config.scheduler.max_num_seqs:
            raise NoCapacity(f"all {self.config.scheduler.max_num_seqs} sequence slots are taken")
        seq = Sequence(request_id, tuple(prompt_token_ids), params, self.pool.layout.block_size)
        # One block of headroom per running sequence keeps admissions from
        # forcing preemptions on the very next step.
        if self.block_manager.num_blocks_needed(seq, seq.num_tokens) + len(sched.running) > \
                self.block_manager.num_free_blocks or not self.block_manager.allocate(seq, seq.num_tokens):
            raise NoCapacity(f"not enough free KV blocks for {seq.num_tokens} tokens")
        seq.status = SequenceStatus.RECEIVING
        self._requests[request_id] = _Request(seq, None)
        self._num_receiving += 1
        return list(seq.block_ids)

    def admit_prefilled(self, request_id: str, first_token_id: int, kv_ready: torch.cuda.Event | None = None) -> None:
        """The reserved blocks hold the prompt's KV: decode from `first_token_id` on.

        `kv_ready`: the KV is still being copied in and is there once this CUDA event has
        completed. The sequence waits outside the batch until then, so that no step (and no
        other sequence) waits for the copy.
        """
        seq = self._requests[request_id].seq
        if seq.status is not SequenceStatus.RECEIVING or seq in self._kv_landing:
            raise ValueError(f"request {request_id!r} is not waiting for its KV")
        if kv_ready is not None and not kv_ready.query():
            self._kv_landing[seq] = (first_token_id, kv_ready)
            return
        self._run_prefilled(seq, first_token_id)

    def _run_prefilled(self, seq: Sequence, first_token_id: int) -> None:
        self._num_receiving -= 1
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.token_ids.append(first_token_id)
        self.block_manager.cache_full_blocks(seq)  # only now: a prefix hit must find the KV there
        self.scheduler.add_running(seq)

    def _admit_landed(self) -> None:
        """Run the sequences whose KV has landed; with nothing else to run, wait for one
        (bounded) rather than spin."""
        if not self.scheduler.has_unfinished:
            _wait_for_copy(next(iter(self._kv_landing.values()))[1])
        for seq, (first_token_id, ready) in list(self._kv_landing.items()):
            if ready.query():
                del self._kv_landing[seq]
                self._run_prefilled(seq, first_token_id)

    def load(self) -> EngineLoad:
        sched, bm = self.scheduler, self.block_manager
        return EngineLoad(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_receiving=self._num_receiving,
            num_held=len(self._held),
            queued_prefill_tokens=sum(s.num_tokens - s.num_computed_tokens for s in sched.waiting)
            + sum(s.num_tokens - s.num_computed_tokens - 1 for s in sched.running),
            num_free_blocks=bm.num_free_blocks,
            num_blocks=bm.num_blocks,
            prefix_queried_tokens=bm.num_prefix_queries,
            prefix_hit_tokens=bm.num_prefix_hits,
            num_preemptions=sched.num_preemptions,
            spec=dataclasses.replace(self.speculator.metrics) if self.speculator is not None else None,
        )

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._kv_landing)

    # Stepping ------------------------------------------------------------

    def set_speculator(self, speculator: Speculator | None) -> None:
        """Speculate with `speculator` from the next step on (None: stop).
        `decode_node.spec.build_speculator` makes one from `config.spec`."""
        self.speculator = speculator

    def set_kv_computed_callback(self, callback: KVComputed | None) -> None:
        """Call `callback(request_id, block_ids, event)` from the step that computes the last
        of a `hold_kv` request's prompt, right after its forward is queued and before the
        sampling waits for it: `event` (CUDA; None on the CPU, where the KV is complete)
        completes once the KV is in `block_ids`. Lets a prefill worker queue the KV's transfer
        while the GPU still computes. Runs on the engine's thread: it must return at once."""
        self._on_kv_computed = callback

    def step(self) -> list[TokenDelta]:
        """Run one iteration; returns a delta for every request that got tokens."""
        if self._kv_landing:
            self._admit_landed()
        proposals = self._propose() if self.speculator is not None else {}
        batch = self.scheduler.schedule()
        if self.speculator is not None:
            for seq in batch.preempted:
                self.speculator.release(seq)
        if not batch.seqs:
            return []
        logits = self.runner.compute_logits(batch)
        if self._on_kv_computed is not None:
            self._report_kv_computed(batch, self._on_kv_computed)
        verifying = {seq: logits.pop(seq) for seq in batch.seqs if seq.spec_token_ids}
        sampled = self.runner.sample(logits)
        deltas = []
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            if seq in verifying:
                deltas.append(self._verify(seq, verifying[seq], proposals[seq]))
                continue
            seq.num_computed_tokens += num_new
            self.block_manager.cache_full_blocks(seq)
            if seq in sampled:
                deltas.append(self._append_token(seq, *sampled[seq]))
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

    def _propose(self) -> dict[Sequence, Proposal]:
        """Draft tokens for every running sequence that is decoding (its last token
        is the only one without KV); they are verified in this step's pass."""
        assert self.speculator is not None
        seqs, limits = [], []
        for seq in self.scheduler.running:
            seq.spec_token_ids.clear()
            # The accepted tokens plus the target's own must fit max_tokens and the context.
            limit = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
            if seq.num_computed_tokens == seq.num_tokens - 1 and limit > 0:
                seqs.append(seq)
                limits.append(limit)
        if not seqs:
            return {}
        proposals = [p.truncated(n) for p, n in zip(self.speculator.propose(seqs, limits), limits)]
        for seq, proposal in zip(seqs, proposals):
            seq.spec_token_ids.extend(proposal.token_ids)
        return dict(zip(seqs, proposals))

    def _verify(self, seq: Sequence, logits: torch.Tensor, proposal: Proposal) -> TokenDelta:
        """Keep the proposed tokens the target accepts, plus one of its own.

        logits: [1 + K, vocab] from this step's pass over the last token and the
        K proposed tokens the scheduler kept (`seq.spec_token_ids`).
        """
        assert self.speculator is not None
        params = seq.params
        proposal = proposal.truncated(len(seq.spec_token_ids))
        seq.spec_token_ids.clear()
        token_ids = self.speculator.verify(seq, proposal, self.sampler.probs(logits, params),
                                           self.sampler.generator(seq.request_id, params))
        # The last token and the accepted proposals now have KV; the rejected
        # ones' slots are garbage and get overwritten or trimmed.
        seq.num_computed_tokens = seq.num_tokens + len(token_ids) - 1
        logprobs: list[Any] = (self.sampler.logprobs(logits[:len(token_ids)], token_ids, params)
                               if params.logprobs is not None else [None] * len(token_ids))
        deltas = []
        for token_id, lp in zip(token_ids, logprobs):
            deltas.append(self._append_token(seq, token_id, lp))
            if seq.is_finished:  # a stop token among the accepted ones: drop the rest
                break
        if not seq.is_finished:
            self.block_manager.trim(seq, seq.num_computed_tokens)
            self.block_manager.cache_full_blocks(seq)
        return _merge_deltas(deltas)

    def _append_token(self, seq: Sequence, token_id: int, logprobs: Any) -> TokenDelta:
        req = self._requests[seq.request_id]
        seq.token_ids.append(token_id)
        params = seq.params
        reason = None
        if (token_id in params.stop_token_ids
                or (not params.ignore_eos and token_id in self.arch.eos_token_ids)):
            reason = FinishReason.STOP
        hit_stop_string = req.detokenizer.add(token_id) if req.detokenizer else False
        if hit_stop_string:
            reason = FinishReason.STOP
        elif reason is None and (seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len):
            reason = FinishReason.LENGTH
        text = req.detokenizer.take_delta(reason is not None) if req.detokenizer else ""
        if reason is not None:
            self._finish(seq, reason)
        held = tuple(seq.block_ids) if seq.request_id in self._held else ()
        return TokenDelta(seq.request_id, (token_id,), text, reason, (logprobs,) if logprobs else (),
                          seq.num_prompt_tokens, seq.num_cached_tokens, held)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        req = self._requests.pop(seq.request_id)
        landing = self._kv_landing.pop(seq, None)
        if landing is not None and not _wait_for_copy(landing[1]):  # free the blocks after the copy into them
            logger.warning("KV copy into request %s's blocks not done after %.0f s: freeing them anyway",
                           seq.request_id, COPY_WAIT_S)
        if seq.status is SequenceStatus.RECEIVING:
            self._num_receiving -= 1
        hold = req.hold_kv and reason is not FinishReason.ABORT
        self.scheduler.finish(seq, reason, free_blocks=not hold)
        if hold:
            self._held[seq.request_id] = seq
        self.sampler.release(seq.request_id)
        if self.speculator is not None:
            self.speculator.release(seq)

    # Offline batch API ---------------------------------------------------

    def generate_stream(self, prompts: list[Prompt], params: SamplingParams | list[SamplingParams] | None = None
                        ) -> Iterator[TokenDelta]:
        """Run `prompts` to completion, yielding deltas as they come.

        Every prompt is validated (ValueError) before any is queued. Closing
        the iterator early aborts what is still running.
        """
        return self._stream(self._submit(prompts, params))

    def generate(self, prompts: list[Prompt], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run `prompts` to completion; one output per prompt, in order."""
        ids = self._submit(prompts, params)
        outputs = {rid: RequestOutput(rid, self._requests[rid].seq.prompt_token_ids) for rid in ids}
        for delta in self._stream(ids):
            outputs[delta.request_id].add(delta)
        return [outputs[rid] for rid in ids]

    def _submit(self, prompts: list[Prompt], params: SamplingParams | list[SamplingParams] | None) -> list[str]:
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        token_lists = [self.tokenize(p) for p in prompts]
        for ids, p in zip(token_lists, params_list):
            self._validate(ids, p)
        return [self.add_request(t, p) for t, p in zip(token_lists, params_list)]

    def _stream(self, request_ids: list[str]) -> Iterator[TokenDelta]:
        pending = set(request_ids)
        try:
            while pending:
                for delta in self.step():
                    if delta.request_id in pending:
                        yield delta
                        if delta.finished:
                            pending.discard(delta.request_id)
        finally:
            for rid in pending:
                self.abort(rid)


def _wait_for_copy(event: torch.cuda.Event) -> bool:
    """`event.synchronize()`, bounded by COPY_WAIT_S (CUDA offers no timeout, so a helper
    thread waits); whether the copy completed."""
    if event.query():
        return True
    waiter = threading.Thread(target=event.synchronize, name="kv-copy-wait", daemon=True)
    waiter.start()
    waiter.join(COPY_WAIT_S)
    return not waiter.is_alive()


def _merge_deltas(deltas: list[TokenDelta]) -> TokenDelta:
    """One delta for the tokens a request got in one step (several when speculating)."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    return TokenDelta(last.request_id, tuple(t for d in deltas for t in d.token_ids), "".join(d.text for d in deltas),
                      last.finish_reason, tuple(lp for d in deltas for lp in d.logprobs),
                      last.num_prompt_tokens, last.num_cached_tokens, last.held_block_ids)


def _blocks_that_fit(config: EngineConfig, layout: KVLayout, device: torch.device) -> int:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        # Leave room for activations and logits of the largest step.
        reserve = 2 * 2**30
        budget = free - (1 - config.cache.gpu_memory_utilization) * total - reserve
    else:
        budget = config.cache.cpu_kv_cache_gib * 2**30
    num_blocks = int(budget // layout.bytes_per_block)
    if num_blocks < 1:
        raise ValueError("no memory left for the KV cache; lower the model size or raise the memory budget")
    return num_blocks
