"""Structured outputs in the offline engine, on the real default model: constrained answers
(greedy and sampled) parse and follow their JSON schemas, while the same prompts without
the constraint do not; a constrained request in a batch leaves the others' greedy tokens
unchanged; bad schemas are refused by name; the speculation masks follow the grammar."""

from __future__ import annotations

import json
import math

import pytest
import torch

from pdserve.engine.grammar import StructuredOutputs
from pdserve.engine.sampling import SamplingParams, StructuredOutput
from pdserve.engine.sequence import FinishReason, Sequence
from tests.engine.grammar_cases import MAX_TOKENS, PROMPT, SCHEMAS, validates

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine()


@pytest.fixture(scope="module")
def chat(engine) -> list[int]:
    return engine.apply_chat_template([{"role": "user", "content": PROMPT}])


SEEDS = (1, 2, 3)


def constrained(schema: dict | None, **kwargs) -> SamplingParams:
    structured = StructuredOutput.from_schema(schema) if schema is not None else StructuredOutput("json_object")
    return SamplingParams(**{"max_tokens": MAX_TOKENS, **kwargs}, structured=structured)


def test_every_answer_follows_its_schema_greedy_and_sampled(engine, chat):
    cases = [(name, kwargs) for name in SCHEMAS
             for kwargs in ({"temperature": 0.0}, *({"temperature": 1.0, "seed": seed} for seed in SEEDS))]
    outs = engine.generate([chat] * len(cases), [constrained(SCHEMAS[name], **kw) for name, kw in cases])
    for (name, kwargs), out in zip(cases, outs):
        assert validates(out.text, SCHEMAS[name]), (name, kwargs, out.text)
        assert out.finish_reason is FinishReason.STOP  # ended by the grammar, not by max_tokens
    # Without the constraint the same prompt, with the same seeds, gives prose, not JSON that
    # follows the schemas: the constraint is what makes the answers valid.
    free = engine.generate([chat] * len(SEEDS), [SamplingParams(temperature=1.0, seed=seed, max_tokens=MAX_TOKENS)
                                                 for seed in SEEDS])
    assert not any(validates(out.text, schema) for out in free for schema in SCHEMAS.values())


def test_json_object_gives_a_json_object(engine, chat):
    outs = engine.generate([chat] * 2, [constrained(None, temperature=0.0, logprobs=3, max_tokens=32),
                                        constrained(None, temperature=1.0, seed=3, max_tokens=32)])
    # Logprobs of the masked distribution: tokens the grammar forbids are far below, but finite.
    assert all(math.isfinite(v) for lp in outs[0].logprobs for v in (lp.logprob, *lp.top_logprobs))
    for out in outs:
        if out.finish_reason is FinishReason.STOP:
            assert isinstance(json.loads(out.text), dict), out.text
        else:  # a long object may not close within max_tokens, but it is one in the making
            assert out.text.startswith("{"), out.text


def test_constrained_row_leaves_the_others_greedy_tokens_unchanged(engine, chat):
    others = [engine.tokenize("The capital of France is"), chat]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = [o.token_ids for o in engine.generate(others, greedy)]
    mixed = engine.generate([others[0], chat, others[1]],
                            [greedy, constrained(SCHEMAS["nested"], temperature=1.0, seed=5), greedy])
    assert [mixed[0].token_ids, mixed[2].token_ids] == alone
    assert validates(mixed[1].text, SCHEMAS["nested"])
    assert not engine.structured.has_active  # every matcher released: steps overlap again


@pytest.mark.parametrize("schema, message", [
    ('{"type": "nope"}', 'Unsupported type "nope"'),
    ('{"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}', "missing"),
    ("[1, 2]", "object or a boolean"),
    ("{not json", "not valid JSON"),
])
def test_bad_schemas_are_refused_by_name(engine, schema, message):
    with pytest.raises(ValueError, match="response_format") as e:
        engine.add_request("Hi", SamplingParams(structured=StructuredOutput.from_schema(schema)))
    assert message in str(e.value)
    assert not engine.has_unfinished


def test_masks_for_a_proposal_follow_the_grammar_and_roll_back(engine, tokenizer):
    so = StructuredOutputs(tokenizer, engine.arch.vocab_size, engine.arch.eos_token_ids)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    seq = Sequence("r", (1, 2, 3), constrained(schema), 16)
    good = tokenizer.encode('{"ok":true}', add_special_tokens=False)
    bad = tokenizer.encode("hello", add_special_tokens=False)
    proposal = good[:2] + bad[:1] + good[2:3]
    masks = so.masks_for_proposal(seq, proposal)
    assert masks.shape == (len(proposal) + 1, engine.arch.vocab_size) and masks.dtype == torch.bool
    assert masks[0, good[0]] and masks[1, good[1]] and not masks[2, bad[0]]
    assert torch.equal(masks[3], masks[2]) and torch.equal(masks[4], masks[2])  # never used; finite
    assert torch.equal(so.masks_for_proposal(seq, [])[0], masks[0])  # rolled back: nothing accepted
    # The accepted tokens advance the matcher (a decode worker's sequence arrives with some).
    seq.token_ids += good
    assert so.accept(seq)  # complete: only EOS could follow
    assert not so.accept(Sequence("s", (1,), SamplingParams(), 16))  # unconstrained: never
    logits = torch.zeros(3, engine.arch.vocab_size)
    so.release(seq)
    seq2 = Sequence("r2", (1, 2, 3), constrained(schema), 16)
    so.mask_proposal(seq2, logits, good[:2])
    lowest = torch.finfo(logits.dtype).min
    assert (logits == lowest).any(dim=-1).all() and (logits[torch.arange(3), good[:3]] == 0).all()


def test_no_raw_control_character_inside_a_bounded_string(engine, tokenizer):
    """xgrammar (0.2.9) lets raw control characters into a string with a maxLength, which no
    JSON parser takes (the small model's random text once wrote `"city":"...\\x07"`): the
    masks allow none, in a string as anywhere else; printable text stays allowed."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}
    so = StructuredOutputs(tokenizer, engine.arch.vocab_size, engine.arch.eos_token_ids)
    seq = Sequence("r", (1, 2, 3), constrained(schema), 16)
    seq.token_ids += tokenizer.encode('{"city":"', add_special_tokens=False)
    allowed = so.masks_for_proposal(seq, [])[0]
    control = [i for i in range(len(tokenizer)) if any(ord(c) < 0x20 for c in tokenizer.decode([i]))]
    assert control and not allowed[control].any()
    assert allowed[tokenizer.encode("Paris", add_special_tokens=False)[0]]
