"""Speculation on the real default model: greedy output is token-identical to
plain decoding for every drafter, in a continuous batch where some sequences
speculate while others decode or prefill; draft = target accepts everything;
the metrics agree with the tokens counted."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pdserve.engine.config import EngineConfig, ModelConfig, SpecConfig
from pdserve.engine.engine import Engine
from pdserve.engine.messages import WorkerRequest
from pdserve.engine.models.arch import DUMMY_SHAPES
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.sequence import Sequence
from pdserve.engine.speculative import SpecDecoder
from pdserve.engine.speculative.drafter import Drafter
from pdserve.engine.speculator import Proposals
from tests.engine.prompts import PASSAGE, prompt_ids

pytestmark = pytest.mark.slow

SPECULATING = ("chat", "copy")
DRAFTERS = {
    "ngram": SpecConfig(method="ngram", num_speculative_tokens=5),
    "self_draft": SpecConfig(method="self_draft", num_draft_layers=8, num_speculative_tokens=3),
    "draft_model": SpecConfig(method="draft_model", draft_model="default", num_speculative_tokens=4),
    "self_draft_adaptive": SpecConfig(method="self_draft", num_draft_layers=8, num_speculative_tokens=4,
                                      adaptive=True),
}


class OnlySome:
    """Lets only some requests speculate, so the batch mixes both kinds."""

    def __init__(self, inner: Drafter, request_ids: tuple[str, ...]) -> None:
        self.inner = inner
        self.request_ids = request_ids
        self.proposed_for: set[str] = set()

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposals:
        num_tokens = [k if s.request_id in self.request_ids else 0 for s, k in zip(seqs, num_tokens)]
        out = self.inner.propose(seqs, num_tokens)
        self.proposed_for.update(s.request_id for s, k in zip(seqs, out.num_tokens) if k)
        return out

    def catch_up(self, seqs: list[Sequence], token_ids: torch.Tensor, num_accepted: torch.Tensor) -> None:
        self.inner.catch_up(seqs, token_ids, num_accepted)

    def settle(self, seqs: list[Sequence], token_ids: list[list[int]]) -> None:
        self.inner.settle(seqs, token_ids)

    def release(self, seq: Sequence) -> None:
        self.inner.release(seq)


@pytest.fixture(scope="module")
def engine(make_engine) -> Engine:
    # A small token budget chunks the long prompt across steps that also verify proposals.
    return make_engine(max_num_batched_tokens=48)


@pytest.fixture(scope="module")
def requests(engine) -> list[tuple[str, list[int], SamplingParams]]:
    chat = engine.apply_chat_template([{"role": "user", "content": "Name three uses of a paperclip."}])
    copy = engine.apply_chat_template([{"role": "user", "content": "Repeat this text word for word: "
                                        + PASSAGE[:400]}])
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    return [
        ("chat", chat, greedy),
        ("copy", copy, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)),
        ("long", prompt_ids(engine.tokenizer, 150, variant=3), greedy),
        ("short", engine.tokenize("The capital of France is"), SamplingParams(temperature=0.0, max_tokens=25)),
    ]


def run(engine: Engine, requests) -> tuple[dict[str, list[int]], dict[str, int], dict[str, list]]:
    """Token ids, number of deltas and logprobs per request id."""
    tokens = {rid: [] for rid, _, _ in requests}
    num_deltas = dict.fromkeys(tokens, 0)
    logprobs = {rid: [] for rid in tokens}
    for rid, prompt, params in requests:
        engine.add_request(prompt, params, rid)
    while engine.has_unfinished:
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.token_ids)
            logprobs[delta.request_id].extend(delta.logprobs)
            num_deltas[delta.request_id] += 1
    return tokens, num_deltas, logprobs


@pytest.fixture(scope="module")
def baseline(engine, requests):
    engine.speculate(None)
    return run(engine, requests)


def all_blocks_free(engine: Engine) -> bool:
    return engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_greedy_is_token_identical_in_a_mixed_batch(engine, requests, baseline, name):
    engine.speculate(DRAFTERS[name])
    spec = engine.speculator
    assert isinstance(spec, SpecDecoder)
    spec.drafter = OnlySome(spec.drafter, SPECULATING)
    try:
        tokens, num_deltas, logprobs = run(engine, requests)
    finally:
        engine.speculate(None)
    assert tokens == baseline[0]
    assert spec.drafter.proposed_for == set(SPECULATING)
    assert all_blocks_free(engine)
    m = spec.metrics
    assert m.num_proposed > 0
    # A step gives a speculating request 1 + (accepted proposals) tokens: whatever
    # a request got beyond one token per step was accepted from a draft.
    assert m.num_accepted == sum(len(tokens[r]) - num_deltas[r] for r in SPECULATING)
    assert m.num_passes <= sum(num_deltas[r] - 1 for r in SPECULATING)
    # Logprobs come from the verification pass's rows: the same values as plain decoding.
    assert [lp.token_id for lp in logprobs["copy"]] == tokens["copy"]
    for got, want in zip(logprobs["copy"], baseline[2]["copy"]):
        assert got.top_token_ids == want.top_token_ids
        assert got.logprob == pytest.approx(want.logprob, abs=1e-3)


class EveryOther(SpecDecoder):
    """Plans K = 0 and K in turn: plain steps (which overlap the step before) and speculative
    ones (which first resolve the step in flight) follow each other."""

    def __init__(self, inner: SpecDecoder) -> None:
        super().__init__(inner.drafter, inner.sampler, inner.num_speculative_tokens)
        self.plans: list[int] = []

    def plan(self, seqs: list[Sequence]) -> int:
        k = self.num_speculative_tokens if len(self.plans) % 2 else 0
        self.plans.append(k)
        self.metrics.record_step(k)
        return k


def test_steps_at_k_zero_overlap_and_greedy_output_is_unchanged(engine, requests, baseline):
    engine.speculate(DRAFTERS["self_draft"])
    spec = EveryOther(engine.speculator)
    engine.core.set_speculator(spec)  # a test double of the plan, around what the builder made
    tokens = {rid: [] for rid, _, _ in requests}
    overlapped = 0
    try:
        for rid, prompt, params in requests:
            engine.add_request(prompt, params, rid)
        while engine.has_unfinished:
            for delta in engine.step():
                tokens[delta.request_id].extend(delta.token_ids)
            overlapped += engine.core.in_flight is not None  # the step just queued resolves in the next call
    finally:
        engine.speculate(None)
    assert tokens == baseline[0]
    assert 0 in spec.plans and spec.num_speculative_tokens in spec.plans
    assert overlapped >= spec.plans.count(0) // 2  # plain steps overlapped (some are the last ones)
    assert spec.metrics.num_proposed > 0 and spec.metrics.num_accepted > 0
    assert all_blocks_free(engine)


@pytest.mark.parametrize("spec_config", [
    SpecConfig(method="self_draft", num_draft_layers=30, num_speculative_tokens=6),  # all layers: the target
    SpecConfig(method="draft_model", draft_model="default", num_speculative_tokens=6),
], ids=["self_draft_all_layers", "draft_model_same_model"])
def test_draft_equal_to_target_accepts_everything(engine, requests, baseline, spec_config):
    engine.speculate(spec_config)
    spec = engine.speculator
    try:
        tokens, num_deltas, _ = run(engine, requests)
    finally:
        engine.speculate(None)
    assert tokens == baseline[0]
    # Proposals after the first start from the catch-up that ran behind their verification
    # (its KV, had it been wrong, would have made the equal draft disagree).
    assert spec.drafter.num_caught_up > 0
    m = spec.metrics
    assert m.num_proposed > 0 and m.num_accepted == m.num_proposed and m.num_rejections == 0
    assert m.alpha == 1.0 and m.acceptance_rate == 1.0
    assert m.num_accepted == sum(len(tokens[r]) - num_deltas[r] for r in tokens)


TRIMMED = 4096  # of SmolLM2's 49,152 token ids


@pytest.mark.parametrize("method", ["draft_model", "self_draft"])
def test_a_draft_head_trimmed_to_the_first_ids_keeps_greedy_output(engine, requests, baseline, method):
    """Draft = target (all its layers) with a head that scores only the first TRIMMED ids:
    it proposes the target's own token wherever that lies below TRIMMED, so every rejection
    is a token at or past it, which the target then emits itself. The self-draft's head is a
    view of the target's rows, not a copy."""
    config = SpecConfig(method=method, draft_model="default", num_draft_layers=30, num_speculative_tokens=4,
                        draft_vocab_size=TRIMMED)
    engine.speculate(config)
    spec = engine.speculator
    head = spec.drafter.runner.model.lm_head.weight
    assert head.shape == (TRIMMED, engine.arch.hidden_size)
    if method == "self_draft":
        assert head.data_ptr() == engine.model.lm_head.weight.data_ptr()
    try:
        tokens, num_deltas, _ = run(engine, requests)
    finally:
        engine.speculate(None)
    assert tokens == baseline[0]
    beyond = sum(t >= TRIMMED for ids in tokens.values() for t in ids)
    assert beyond > 0  # the outputs hold ids the draft cannot propose
    m = spec.metrics
    assert 0 < m.num_rejections <= beyond
    assert m.num_accepted == sum(len(tokens[r]) - num_deltas[r] for r in tokens)
    assert m.num_accepted > m.num_proposed // 2
    assert all_blocks_free(engine)


def test_a_draft_head_of_listed_ids_proposes_those_tokens(engine, requests, baseline, tmp_path):
    """A ranking file whose first ids are exactly the tokens of the baseline's outputs (a
    few hundred, scattered over the vocabulary), then everything else: the draft (= target)
    keeps only those, so its column j must stand for listed token j. It then accepts
    every proposal; had a column been read as its own index, it would accept almost none."""
    used = sorted({t for ids in baseline[0].values() for t in ids})
    assert used[-1] >= len(used)  # not the first ids: the head's columns are not token ids
    ranking = used + [t for t in range(engine.arch.vocab_size) if t not in set(used)]
    path = tmp_path / "freq.pt"
    torch.save(torch.tensor(ranking), path)
    config = SpecConfig(method="draft_model", draft_model="default", num_speculative_tokens=4,
                        draft_vocab_size=len(used), draft_vocab_file=str(path))
    engine.speculate(config)
    spec = engine.speculator
    assert spec.drafter.runner.model.lm_head.weight.shape == (len(used), engine.arch.hidden_size)
    try:
        tokens, _, _ = run(engine, requests)
    finally:
        engine.speculate(None)
    assert tokens == baseline[0]
    m = spec.metrics
    assert m.num_proposed > 0 and m.num_accepted == m.num_proposed
    assert all_blocks_free(engine)


def test_bad_drafts_are_refused_at_start(engine, monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="self-draft layers must be in"):
        engine.speculate(SpecConfig(method="self_draft", num_draft_layers=31))
    with pytest.raises(ValueError, match=r"draft_vocab_size must be in \[1, 49152\].*got 49153"):
        engine.speculate(SpecConfig(method="self_draft", draft_vocab_size=49153))
    files = {"missing.json": None, "far.json": "[1, 2, 49152]", "twice.json": "[5, 6, 5]", "text.json": "nope",
             "empty.json": "[]"}
    for name, text in files.items():
        if text is not None:
            (tmp_path / name).write_text(text)
    for name, message in [("missing.json", "cannot be read"), ("far.json", "token id 49152 is outside"),
                          ("twice.json", "lists a token id twice"), ("text.json", "cannot be read"),
                          ("empty.json", "non-empty list of token ids")]:
        with pytest.raises(ValueError, match=f"draft_vocab_file .*{name}.*{message}"):
            engine.speculate(SpecConfig(method="self_draft", draft_vocab_file=str(tmp_path / name)))
    (tmp_path / "short.json").write_text("[3, 1, 2]")
    with pytest.raises(ValueError, match=r"draft_vocab_size must be in \[1, 3\] \(the file's 3 ids\), got 4"):
        engine.speculate(SpecConfig(method="self_draft", draft_vocab_size=4,
                                            draft_vocab_file=str(tmp_path / "short.json")))
    with pytest.raises(ValueError, match="vocabulary size 512 differs"):
        engine.speculate(SpecConfig(method="draft_model", draft_model="dummy:tiny"))
    tiny = Engine(EngineConfig(model=ModelConfig(source="dummy:tiny", device="cpu", dtype="float32")))
    monkeypatch.setitem(DUMMY_SHAPES, "tiny-deeper", replace(DUMMY_SHAPES["tiny"], num_layers=4))
    with pytest.raises(ValueError, match="larger than the target"):
        tiny.speculate(SpecConfig(method="draft_model", draft_model="dummy:tiny-deeper"))


def test_decode_worker_path_builds_the_draft_kv_from_the_received_prompt(engine, make_engine):
    """Disaggregated: the prompt's KV comes from another engine (a prefill worker);
    the draft has none and catches up from the prompt tokens on its first proposal."""
    prompt = engine.apply_chat_template([{"role": "user", "content": "Repeat word for word: " + PASSAGE[:300]}])
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    engine.speculate(None)
    want = engine.generate([prompt], params)[0].token_ids

    prefill = make_engine()
    rid = prefill.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1), hold_kv=True)
    first_token, held = None, ()
    while prefill.has_unfinished:
        for delta in prefill.step():
            first_token, held = delta.token_ids[0], delta.held_block_ids
    assert held, "the last delta of a hold_kv request names its blocks"
    dst = engine.reserve(WorkerRequest("received", tuple(prompt), params))
    engine.pool.kv[:, :, dst] = prefill.pool.kv[:, :, list(held)]
    prefill.release(rid)
    engine.admit_prefilled("received", first_token)

    engine.speculate(DRAFTERS["self_draft"])
    spec = engine.speculator
    got = [first_token]
    try:
        while engine.has_unfinished:
            for delta in engine.step():
                got.extend(delta.token_ids)
    finally:
        engine.speculate(None)
    assert got == want
    assert spec.metrics.num_passes > 0
    assert all_blocks_free(engine)


def test_abort_and_finish_free_the_draft_kv_too(engine):
    engine.speculate(DRAFTERS["self_draft"])
    spec = engine.speculator
    draft_blocks = spec.drafter.block_manager
    try:
        story = engine.add_request("Tell me a story about a dragon.",
                                   SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
        engine.add_request("Count from one to twenty:", SamplingParams(temperature=0.7, max_tokens=12, seed=3))
        for _ in range(3):
            engine.step()
        assert draft_blocks.num_free_blocks < draft_blocks.num_blocks
        assert engine.abort(story)
        while engine.has_unfinished:
            engine.step()
    finally:
        engine.speculate(None)
    assert draft_blocks.num_free_blocks == draft_blocks.num_blocks
    assert all_blocks_free(engine)


def test_preemption_under_speculation_keeps_greedy_output(make_engine, tokenizer):
    # 24 blocks = 384 slots: two prompts (170 tokens each) are admitted, and outgrow them.
    small = make_engine(num_blocks=24, max_num_batched_tokens=512)
    reqs = [(f"r{i}", prompt_ids(tokenizer, 170, variant=i), SamplingParams(temperature=0.0, max_tokens=40,
                                                                            ignore_eos=True)) for i in range(4)]
    want, _, _ = run(small, reqs)
    before = small.scheduler.num_preemptions
    small.speculate(DRAFTERS["self_draft"])
    got, _, _ = run(small, [(f"s{i}", p, params) for i, (_, p, params) in enumerate(reqs)])
    assert small.scheduler.num_preemptions > before, "the pool was meant to be too small: no preemption happened"
    assert list(got.values()) == list(want.values())
    assert all_blocks_free(small)


def test_an_engine_speculates_as_its_config_says():
    """`Engine(config)` honours `config.spec` (the workers, the CLI and the tests build engines
    only this way): the n-gram drafter proposes and the output stays the plain engine's."""
    config = EngineConfig(model=ModelConfig(source="dummy:tiny", device="cpu", dtype="float32"))
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = Engine(config)
    assert plain.speculator is None
    want = plain.generate([prompt], params)[0].token_ids
    engine = Engine(replace(config, spec=SpecConfig(method="ngram", num_speculative_tokens=3)))
    assert isinstance(engine.speculator, SpecDecoder)
    assert engine.generate([prompt], params)[0].token_ids == want
    assert engine.speculator.metrics.num_proposed > 0
