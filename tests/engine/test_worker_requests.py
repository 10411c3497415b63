"""Validated once, where a request enters: the offline `Engine` validates what it is given
(`add_request`, `generate`), while a worker's way in (`add_worker_request`, `reserve`) trusts
a `WorkerRequest` that a frontend validated, on an integrity check alone; and a schema is
compiled once per request, the prefill engine's grammar handed to the decode engine."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.engine.messages import BadWorkerRequest, WorkerRequest
from pdserve.engine.sampling import SamplingParams, StructuredOutput
from tests.engine.grammar_cases import MAX_TOKENS, PROMPT, SCHEMAS, validates

VOCAB, CONTEXT = 100, 64


@pytest.mark.parametrize("req, problem", [
    (WorkerRequest("r", (), SamplingParams()), "the prompt has 0 tokens"),
    (WorkerRequest("r", (1,) * CONTEXT, SamplingParams()), f"the prompt has {CONTEXT} tokens"),
    (WorkerRequest("r", (1, VOCAB), SamplingParams()), "a prompt token id is outside the vocabulary"),
    (WorkerRequest("r", (1, -1), SamplingParams()), "a prompt token id is outside the vocabulary"),
    (WorkerRequest("r", [1, 2], SamplingParams()), "prompt_token_ids must be a tuple"),
    (WorkerRequest("r", (1, 2), SamplingParams(), num_prior_output_tokens=3), "num_prior_output_tokens 3"),
    (WorkerRequest("r", (1, 2), SamplingParams(stop_token_ids=(VOCAB,))), "a stop or logit_bias token id"),
    (WorkerRequest("r", (1, 2), SamplingParams(logit_bias={VOCAB + 5: 1.0})), "a stop or logit_bias token id"),
    (WorkerRequest("r", (1, 2), SamplingParams(stop=("x",))), "stop strings are the frontend's"),
    (WorkerRequest("r", (1, 2), SamplingParams(structured=StructuredOutput("json_object"))),
     "a structured output needs the model's tokenizer"),
])
def test_the_integrity_check_refuses_what_an_engine_cannot_run(req, problem):
    with pytest.raises(BadWorkerRequest, match="worker request 'r' failed its integrity check") as e:
        req.check(VOCAB, CONTEXT, has_tokenizer=False)
    assert problem in str(e.value) and "validated where they enter" in str(e.value)
    assert isinstance(e.value, ValueError)  # the workers' callers see a ValueError, as before


def test_the_integrity_check_passes_a_validated_request():
    WorkerRequest("r", (0, VOCAB - 1), SamplingParams(stop_token_ids=(VOCAB - 1,)), 2).check(VOCAB, CONTEXT, False)



@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine()


@pytest.mark.slow
def test_a_worker_request_that_fails_the_check_is_refused_and_changes_nothing(engine):
    vocab = engine.arch.vocab_size
    bad = WorkerRequest("bad", (1, vocab), SamplingParams())
    for way_in in (engine.add_worker_request, engine.reserve):
        with pytest.raises(BadWorkerRequest, match="'bad' failed its integrity check: a prompt token id is outside"):
            way_in(bad)
    assert not engine.has_unfinished and "bad" not in engine.core.requests
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.slow
def test_the_offline_engine_still_validates(engine, monkeypatch):
    """`add_request` and `generate` run the request processor (its messages, not the integrity
    check's), the schema checked there; `add_worker_request` does not run it."""
    import pdserve.engine.grammar as grammar

    checked = []
    check = grammar.check_structured
    monkeypatch.setattr(grammar, "check_structured", lambda s: (checked.append(s), check(s)))
    with pytest.raises(ValueError, match=r"prompt has token ids \[-1\] outside the vocabulary"):
        engine.add_request([5, -1], SamplingParams())
    with pytest.raises(ValueError, match="response_format: unsupported or invalid JSON schema"):
        engine.generate(["Hi"], SamplingParams(structured=StructuredOutput.from_schema('{"type": "nope"}')))
    assert len(checked) == 1
    rid = engine.add_worker_request(WorkerRequest("trusted", (1, 2, 3), SamplingParams(
        max_tokens=1, structured=StructuredOutput("json_object"))))
    assert len(checked) == 1  # a worker does not validate again
    while engine.has_unfinished:
        engine.step()
    assert rid == "trusted" and not engine.has_unfinished


@pytest.mark.slow
def test_a_schema_is_compiled_once_across_prefill_and_decode(make_engine):
    """The prefill engine compiles the request's grammar for its first token and hands it,
    serialized, to the decode engine, which compiles nothing; the decode engine's cache then
    serves the same schema by key, and the answer is the offline engine's."""
    prefill, decode = make_engine(), make_engine()
    prompt = tuple(decode.apply_chat_template([{"role": "user", "content": PROMPT}]))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                            structured=StructuredOutput.from_schema(SCHEMAS["nested"]))
    req = WorkerRequest("r", prompt, params)

    prefill.add_worker_request(dataclasses.replace(req, params=dataclasses.replace(params, max_tokens=1)),
                               hold_kv=True)
    (first,) = [d for _ in range(4) for d in prefill.step()]
    grammar = prefill.structured.export(params.structured)
    assert prefill.structured.num_compiled == 1 and grammar is not None
    assert prefill.structured.export(params.structured) is grammar  # serialized once, not per request
    dst = decode.reserve(req)
    decode.pool.kv[:, :, dst] = prefill.pool.kv[:, :, list(first.held_block_ids)]
    assert prefill.release("r")
    decode.admit_prefilled("r", first.token_ids[0], grammar=grammar)
    token_ids = list(first.token_ids)
    while decode.has_unfinished:
        token_ids += [t for d in decode.step() for t in d.token_ids]
    assert decode.structured.num_compiled == 0  # the prefill engine's grammar, adopted

    text = decode.tokenizer.decode(token_ids, skip_special_tokens=True)
    assert validates(text, SCHEMAS["nested"]), text
    (alone,) = decode.generate([list(prompt)], params)
    assert list(alone.token_ids) == token_ids
    assert decode.structured.num_compiled == 0  # the same schema again: the cache's, by key
    decode.generate([list(prompt)], dataclasses.replace(
        params, structured=StructuredOutput.from_schema(SCHEMAS["bounded_numbers"])))
    assert decode.structured.num_compiled == 1  # another schema: compiled here


@pytest.mark.slow
def test_a_grammar_for_another_tokenizer_is_dropped_and_compiled_here(engine, tokenizer):
    """xgrammar checks the tokenizer's metadata of a serialized grammar: one made for another
    vocabulary is not adopted (a warning), and the engine compiles its own when needed."""
    import xgrammar as xgr

    from pdserve.engine.grammar import StructuredOutputs

    structured = StructuredOutput.from_schema(SCHEMAS["bounded_numbers"])
    other = StructuredOutputs(tokenizer, engine.arch.vocab_size + 64, engine.arch.eos_token_ids)
    other._grammar(structured)
    mine = StructuredOutputs(tokenizer, engine.arch.vocab_size, engine.arch.eos_token_ids)
    mine.adopt(structured, other.export(structured))
    assert mine.export(structured) is None
    mine._grammar(structured)
    assert mine.num_compiled == 1 and isinstance(mine._grammar(structured), xgr.CompiledGrammar)
