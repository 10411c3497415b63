"""Structured outputs under speculation, on the real default model: the verification pass
masks each proposed position by the grammar after the tokens before it, so draft tokens
outside the grammar are rejected and the output still follows the schema; greedy output
is token-identical to decoding without speculation."""

from __future__ import annotations

import pytest

from pdserve.engine.config import SpecConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sampling import SamplingParams, StructuredOutput
from pdserve.engine.sequence import FinishReason, Sequence
from pdserve.engine.speculative import SpecDecoder
from pdserve.engine.speculative.drafter import HostDrafter
from pdserve.engine.speculator import Proposals
from tests.engine.grammar_cases import MAX_TOKENS, PROMPT, SCHEMAS, validates

pytestmark = pytest.mark.slow

NGRAM = SpecConfig(method="ngram", num_speculative_tokens=4)


class Scripted(HostDrafter):
    """Proposes a request's known continuation with its third token replaced by one that no
    JSON grammar allows (a newline): the first two are accepted, the third must be rejected."""

    def __init__(self, continuations: dict[str, list[int]], bad_token_id: int, device) -> None:
        self.continuations = continuations
        self.bad_token_id = bad_token_id
        self.device = device

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> Proposals:
        out = []
        for seq, n in zip(seqs, num_tokens):
            done = seq.num_output_tokens
            token_ids = list(self.continuations[seq.request_id][done:done + n])
            if len(token_ids) >= 3:
                token_ids[2] = self.bad_token_id
            out.append(token_ids)
        return Proposals.from_lists(out, self.device)

    def release(self, seq: Sequence) -> None:
        pass


@pytest.fixture(scope="module")
def engine(make_engine) -> Engine:
    return make_engine()


def run(engine: Engine, requests: list[tuple[str, list[int], SamplingParams]]) -> dict[str, list[int]]:
    for rid, prompt, params in requests:
        engine.add_request(prompt, params, rid)
    tokens: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    while engine.has_unfinished:
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.token_ids)
    return tokens


def test_drafts_outside_the_grammar_are_rejected_and_greedy_output_is_unchanged(engine):
    chat = engine.apply_chat_template([{"role": "user", "content": PROMPT}])
    requests = [(name, chat, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                            structured=StructuredOutput.from_schema(schema)))
                for name, schema in SCHEMAS.items()]
    engine.speculate(None)
    want = run(engine, requests)

    engine.speculate(NGRAM, drafter=Scripted(want, engine.tokenize("\n")[0], engine.device))
    spec = engine.speculator
    assert isinstance(spec, SpecDecoder)
    try:
        got = run(engine, requests)
    finally:
        engine.speculate(None)
    assert got == want
    for name, schema in SCHEMAS.items():
        assert validates(engine.tokenizer.decode(got[name], skip_special_tokens=True), schema), name
    m = spec.metrics
    assert m.num_rejections > 0 and m.num_accepted > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_ngram_speculation_keeps_sampled_outputs_valid(engine):
    # The prompt shows JSON the n-gram drafter copies from: some drafts fit, some do not.
    example = '{"name":"Ann","address":{"city":"Paris","zip":75001}}'
    chat = engine.apply_chat_template([{"role": "user", "content": f"Like {example}, {PROMPT}"}])
    schema = SCHEMAS["nested"]
    params = [SamplingParams(temperature=t, seed=s, max_tokens=MAX_TOKENS, structured=StructuredOutput.from_schema(
        schema)) for t, s in ((0.0, None), (1.0, 1), (1.0, 2))]
    engine.speculate(NGRAM)
    spec = engine.speculator
    try:
        outs = engine.generate([chat] * len(params), params)
    finally:
        engine.speculate(None)
    for out in outs:
        assert validates(out.text, schema), out.text
        assert out.finish_reason is FinishReason.STOP
    assert spec.metrics.num_proposed > 0
