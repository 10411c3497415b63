"""Structured outputs: grammar-constrained decoding with xgrammar.

A request whose `SamplingParams.structured` is set gets a grammar matcher here. Its grammar
is compiled once per request across the cluster: each engine keeps its compiled grammars in a
bounded LRU keyed by the constraint (`StructuredOutput`: kind and schema or tag text; the
tokenizer is the engine's own), and a prefill worker hands the one it compiled, serialized
(`export`), to the decode worker, which takes it into its cache (`adopt`) instead of compiling
it again. (xgrammar's own compiler cache is off: it cannot take a grammar compiled elsewhere.)
Each step, the logits of its rows are masked to the tokens the grammar allows after the
tokens it has so far; every accepted token advances the matcher, and the request ends
(STOP) once its grammar is complete. Speculative verification masks each of the K+1
positions by the grammar state after the proposed tokens before it (`masks_for_proposal`),
so a draft token outside the grammar has probability 0 under the target and is rejected.

Batches without a constrained row pay no tensor work: `mask_logits` looks at each row's
params and returns. xgrammar and the tokenizer info and compiler (built once per engine, on
its first constrained request or grammar adopted: ~0.25 s for this tokenizer) are loaded lazily, so engines
that never see a constrained request never load them.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.engine.sampling import StructuredOutput
from pdserve.engine.sequence import Sequence

logger = logging.getLogger(__name__)

# Compact JSON (no free whitespace): a sampled answer cannot ramble in blanks, and ends sooner.
_SEPARATORS = (",", ":")
_CACHE_LIMIT_BYTES = 256 * 2**20
# "[16:06:45] /project/cpp/json_schema_converter.cc:5082: Check failed: (...) is false: " before the message
_XGRAMMAR_PREFIX = re.compile(r"^(\[[\d:]+\] \S+:\d+: )?(Check failed: .*? is false: )?")


def check_structured(structured: StructuredOutput) -> None:
    """Raises ValueError naming what is wrong when xgrammar cannot make a grammar of the schema
    (no tokenizer needed: the frontend checks requests before any engine sees them)."""
    if structured.kind == "json_schema":
        error = schema_error(structured.json_schema)
        if error is not None:
            raise ValueError(f"response_format: unsupported or invalid JSON schema: {error}")
    elif structured.kind == "structural_tag":
        import xgrammar as xgr

        try:
            xgr.Grammar.from_structural_tag(structured.structural_tag)
        except Exception as e:  # the tools' schemas were checked one by one: this is ours
            raise ValueError(f"tools: xgrammar cannot make a grammar of the tool calls: {_clean(e)}") from e


def schema_error(json_schema: str) -> str | None:
    """Why xgrammar cannot make a grammar of a JSON schema (JSON text), or None if it can."""
    import xgrammar as xgr

    try:
        xgr.Grammar.from_json_schema(json_schema, any_whitespace=False, separators=_SEPARATORS)
    except Exception as e:  # xgrammar raises RuntimeError (and others) with the C++ message
        return _clean(e)
    return None


def _clean(e: Exception) -> str:
    return _XGRAMMAR_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)


@dataclass(slots=True)
class _Matcher:
    matcher: Any  # xgr.GrammarMatcher
    num_accepted: int = 0  # output tokens the matcher has consumed
    failed: bool = False  # a token outside the grammar arrived (cannot happen when every step is masked)


class StructuredOutputs:
    """One engine's grammar matchers, one per live constrained sequence.

    tokenizer: the model's HF tokenizer (None: no structured outputs).
    vocab_size: the logits' width; stop_token_ids: what ends a sequence (EOS), which the
    grammar allows once it is complete.
    """

    def __init__(self, tokenizer: Any | None, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self._compiler: Any = None  # xgr.GrammarCompiler, made on the first constrained request
        self._info: Any = None  # its xgr.TokenizerInfo
        # Compiled grammars (xgr.CompiledGrammar) by constraint, least recently used first,
        # bounded by _CACHE_LIMIT_BYTES; the lock because `export` runs on a worker's event loop.
        self._compiled: OrderedDict[StructuredOutput, Any] = OrderedDict()
        self._compiled_bytes = 0
        self._serialized: dict[StructuredOutput, str] = {}  # `export`'s, for the grammars in _compiled
        self._lock = threading.Lock()
        self.num_compiled = 0  # grammars this engine compiled (not taken from its cache or another worker)
        self._no_control_bytes: torch.Tensor | None = None  # packed like a bitmask row: see _fill
        self._matchers: dict[Sequence, _Matcher] = {}

    @property
    def has_active(self) -> bool:
        """Whether a constrained sequence is live (the engine does not overlap steps then)."""
        return bool(self._matchers)

    # The per-step mask ---------------------------------------------------------------

    @torch.inference_mode()  # the logits are inference tensors
    def mask_logits(self, seqs: list[Sequence], *logits: torch.Tensor) -> None:
        """Mask, in place, each constrained sequence's row of each of `logits` ([len(seqs), vocab]
        each, row i seqs[i]'s next token: the rows about to be sampled, and the model's own when
        penalties made those a copy) to the tokens its grammar allows next. Unconstrained rows
        are left alone."""
        rows = [i for i, seq in enumerate(seqs) if seq.params.structured is not None]
        if not rows:
            return
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        for r, i in enumerate(rows):
            self._fill(self._synced(seqs[i]).matcher, bitmask, r)
        allowed = _unpack(bitmask, self.vocab_size, logits[0].device)
        for r, i in enumerate(rows):
            for t in logits:
                apply_mask(t[i:i + 1], allowed[r:r + 1])

    # Speculation ----------------------------------------------------------------------

    def masks_for_proposal(self, seq: Sequence, proposed_ids: list[int]) -> torch.Tensor | None:
        """The tokens the grammar allows at each of the K+1 verified positions of `seq`: after its
        tokens so far, then after each proposed token. bool [K+1, vocab] on the CPU, or None when
        `seq` is unconstrained. Rows after a proposed token outside the grammar repeat the row
        before (that token is rejected, so they are never used; they stay finite). The matcher
        is rolled back: the accepted tokens advance it later, through `accept`."""
        if seq.params.structured is None:
            return None
        import xgrammar as xgr

        state = self._synced(seq)
        matcher, k = state.matcher, len(proposed_ids)
        bitmask = xgr.allocate_token_bitmask(k + 1, self.vocab_size)
        num_advanced = 0
        for i in range(k + 1):
            self._fill(matcher, bitmask, i)
            if i == k or not matcher.accept_token(proposed_ids[i]):
                bitmask[i + 1:] = bitmask[i]
                break
            num_advanced += 1
            if matcher.is_terminated():  # a stop token: nothing the grammar allows follows it
                bitmask[i + 1:] = bitmask[i]
                break
        if num_advanced:
            matcher.rollback(num_advanced)
        return _unpack(bitmask, self.vocab_size, torch.device("cpu"))

    @torch.inference_mode()  # the logits are inference tensors
    def mask_proposal(self, seq: Sequence, logits: torch.Tensor, proposed_ids: list[int],
                      *more: torch.Tensor) -> torch.Tensor:
        """`logits` [K+1, vocab] of a verification pass (and `more` of that shape: the penalized
        copy the proposals are judged by), masked in place by `masks_for_proposal`."""
        allowed = self.masks_for_proposal(seq, proposed_ids)
        if allowed is not None:
            allowed = allowed.to(logits.device, non_blocking=True)
            for t in (logits, *more):
                apply_mask(t, allowed)
        return logits

    # Following the sequence ----------------------------------------------------------

    def accept(self, seq: Sequence) -> bool:
        """Advance `seq`'s matcher over its new tokens; True when the output is complete under its
        grammar (nothing but a stop token could follow) and the request should stop."""
        if seq.params.structured is None:
            return False
        state = self._synced(seq)
        matcher = state.matcher
        if state.failed or matcher.is_terminated():
            return True
        if not matcher.is_completed():
            return False
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        self._fill(matcher, bitmask, 0)
        allowed = _unpack(bitmask, self.vocab_size, torch.device("cpu"))[0]
        allowed[list(self.stop_token_ids)] = False
        return not bool(allowed.any())

    def _fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of `bitmask`: the tokens `matcher` allows next, less every token with a raw
        control byte (< 0x20). Every grammar here is JSON without free whitespace, where no raw
        control character is valid anywhere, but xgrammar (0.2.9) lets them into strings that
        have a maxLength; a random model's text found it (`"city":"...\x07"`, which no JSON
        parser takes)."""
        matcher.fill_next_token_bitmask(bitmask, row)
        bitmask[row] &= self._no_control_bytes

    def release(self, seq: Sequence) -> None:
        self._matchers.pop(seq, None)

    def _synced(self, seq: Sequence) -> _Matcher:
        """`seq`'s matcher, made on first use, having consumed every output token the host knows
        (a decode worker's sequence arrives with the first token a prefill worker sampled)."""
        state = self._matchers.get(seq)
        if state is None:
            state = self._matchers[seq] = _Matcher(self._new_matcher(seq.params.structured))
        start = seq.num_prompt_tokens + state.num_accepted
        for token_id in seq.token_ids[start:seq.num_known_tokens]:
            state.num_accepted += 1
            if state.failed or state.matcher.is_terminated():
                continue
            if not state.matcher.accept_token(token_id):
                logger.warning("request %s: token %d is outside its grammar; stopping it", seq.request_id, token_id)
                state.failed = True
        return state

    def _new_matcher(self, structured: StructuredOutput) -> Any:
        import xgrammar as xgr

        return xgr.GrammarMatcher(self._grammar(structured))

    # Compiled grammars: compiled once, cached by key, handed from a prefill worker ----------

    def _grammar(self, structured: StructuredOutput) -> Any:
        """The compiled grammar of `structured`: from the cache, else compiled and cached."""
        self._ensure_compiler()
        with self._lock:
            compiled = self._compiled.get(structured)
            if compiled is not None:
                self._compiled.move_to_end(structured)
                return compiled
        if structured.kind == "structural_tag":
            compiled = self._compiler.compile_structural_tag(structured.structural_tag)
        elif structured.kind == "json_object":
            # Not strict: an object with any members (strict mode would allow only {}).
            compiled = self._compiler.compile_json_schema('{"type":"object"}', any_whitespace=False,
                                                          separators=_SEPARATORS, strict_mode=False)
        else:
            compiled = self._compiler.compile_json_schema(structured.json_schema, any_whitespace=False,
                                                          separators=_SEPARATORS)
        self.num_compiled += 1
        self._keep(structured, compiled)
        return compiled

    def export(self, structured: StructuredOutput) -> str | None:
        """`structured`'s compiled grammar serialized (xgrammar's JSON, with the tokenizer's
        metadata), for another worker of the same model to `adopt`; None when not compiled here.
        Thread-safe: a prefill worker calls it on its event loop while the engine steps."""
        with self._lock:
            compiled = self._compiled.get(structured)
            serialized = self._serialized.get(structured)
        if compiled is None or serialized is not None:
            return serialized
        serialized = compiled.serialize_json()  # once per grammar: ~40 ms and ~130 KB for a small schema
        with self._lock:
            if structured in self._compiled:
                self._serialized[structured] = serialized
        return serialized

    def adopt(self, structured: StructuredOutput, serialized: str) -> None:
        """Take the compiled grammar of `structured` that another worker `export`ed into the
        cache (unless it is there already). One that does not fit this engine's tokenizer
        (xgrammar checks its metadata) or version is dropped, with a warning: the grammar is
        compiled here when first needed."""
        self._ensure_compiler()
        with self._lock:
            if structured in self._compiled:
                return
        import xgrammar as xgr

        try:
            compiled = xgr.CompiledGrammar.deserialize_json(serialized, self._info)
        except Exception as e:  # xgrammar's DeserializeFormatError / DeserializeVersionError / InvalidJSONError
            logger.warning("a compiled grammar from another worker does not fit this one (%s): compiling it here",
                           _clean(e))
            return
        self._keep(structured, compiled)

    def _keep(self, structured: StructuredOutput, compiled: Any) -> None:
        """Cache `compiled`, evicting the least recently used beyond _CACHE_LIMIT_BYTES."""
        with self._lock:
            if structured in self._compiled:
                return
            self._compiled[structured] = compiled
            self._compiled_bytes += compiled.memory_size_bytes
            while self._compiled_bytes > _CACHE_LIMIT_BYTES and len(self._compiled) > 1:
                key, old = self._compiled.popitem(last=False)
                self._compiled_bytes -= old.memory_size_bytes
                self._serialized.pop(key, None)

    def _ensure_compiler(self) -> None:
        """The tokenizer info and compiler, built on first use (~0.25 s for the default tokenizer)."""
        if self._compiler is not None:
            return
        import xgrammar as xgr

        if self.tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer")
        info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                  stop_token_ids=list(self.stop_token_ids))
        self._no_control_bytes = _packed_tokens_without_control_bytes(info.decoded_vocab, self.vocab_size)
        self._info = info
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def apply_mask(logits_rows: torch.Tensor, allowed: torch.Tensor) -> None:
    """Set, in place, the logits [N, vocab] of tokens that `allowed` (bool [N, vocab], same
    device) does not allow to the dtype's lowest value: probability 0 after softmax, and a
    finite logprob (-inf would reach the APIs' JSON as null), so logprobs of constrained
    requests are those of the masked distribution."""
    logits_rows.masked_fill_(~allowed, torch.finfo(logits_rows.dtype).min)


def _packed_tokens_without_control_bytes(decoded_vocab: list[bytes], vocab_size: int) -> torch.Tensor:
    """int32 [ceil(vocab / 32)] in xgrammar's bitmask packing (bit j of word w: token 32 w + j):
    set for the tokens whose bytes have no control byte (< 0x20)."""
    num_words = (vocab_size + 31) // 32
    keep = torch.ones(num_words * 32, dtype=torch.int64)
    for token_id, token in enumerate(decoded_vocab[:vocab_size]):
        if any(byte < 0x20 for byte in token):
            keep[token_id] = 0
    words = (keep.view(num_words, 32) << torch.arange(32, dtype=torch.int64)).sum(dim=1)  # 0 .. 2**32 - 1
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _unpack(bitmask: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """xgrammar's bitmask (int32 [N, ceil(vocab / 32)], bit j of word w: token 32 w + j) as bool
    [N, vocab] on `device` (one host-to-device copy of the packed words)."""
    words = bitmask.to(device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    bits = (words[:, :, None] >> shifts) & 1
    return bits.reshape(words.shape[0], -1)[:, :vocab_size].bool()
