"""Structured outputs through both APIs of a real server (Ray prefill and decode actors on the
CPU, the small model): `response_format` through the official `openai` client (chat and
completions, json_schema and json_object, greedy and seeded samples, the client's own
`parse` with a pydantic model) and through gRPC; answers parse and follow their schemas; a
bad schema is a 400 / INVALID_ARGUMENT naming the problem and the server keeps serving;
unconstrained requests running beside constrained ones keep their greedy text."""

from __future__ import annotations

import json
from typing import Literal

import grpc
import openai
import pydantic
import pytest

from pdserve.cluster.clients.grpc_client import Client
from pdserve.engine.sampling import SamplingParams, StructuredOutput
from tests.cluster.streams import collect, collect_concurrently
from tests.engine.grammar_cases import MAX_TOKENS, PROMPT, SCHEMAS, validates

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def srv(disaggregated_server):
    # Disaggregated: the prefill worker samples the first token under the grammar, the
    # decode worker's matcher starts from it.
    return disaggregated_server


def json_schema(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_chat_answers_follow_the_schema_greedy_and_seeded(client, model, name):
    greedy = client.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=MAX_TOKENS,
                                            response_format=json_schema(name))
    sampled = client.chat.completions.create(model=model, messages=CHAT, temperature=1.0, seed=11, n=2,
                                             max_tokens=MAX_TOKENS, response_format=json_schema(name))
    for choice in greedy.choices + sampled.choices:
        assert validates(choice.message.content, SCHEMAS[name]), choice.message.content
        assert choice.finish_reason == "stop"


def test_streamed_completion_and_json_object(client, model):
    chunks = client.completions.create(model=model, prompt=f"{PROMPT}\n", temperature=0, max_tokens=MAX_TOKENS,
                                       stream=True, extra_body={"response_format": json_schema("bounded_numbers")})
    chunks = list(chunks)
    assert validates("".join(c.choices[0].text for c in chunks if c.choices), SCHEMAS["bounded_numbers"])
    assert chunks[-1].choices[0].finish_reason == "stop"
    out = client.chat.completions.create(model=model, messages=CHAT, temperature=1.0, seed=4, max_tokens=MAX_TOKENS,
                                         response_format={"type": "json_object"})
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    else:  # an object that did not close within max_tokens
        assert out.choices[0].message.content.startswith("{")


class Pet(pydantic.BaseModel):
    kind: Literal["cat", "dog"]
    legs: int = pydantic.Field(ge=0, le=4)


def test_the_clients_own_parse(client, model):
    out = client.chat.completions.parse(model=model, messages=[{"role": "user", "content": "Describe a pet."}],
                                        temperature=0, max_tokens=MAX_TOKENS, response_format=Pet)
    pet = out.choices[0].message.parsed
    assert isinstance(pet, Pet) and 0 <= pet.legs <= 4


@pytest.mark.parametrize("response_format, message", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}, 'Unsupported type "nope"'),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "needs json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/gone"}}}, "$defs"),
    ({"type": "yaml"}, "response_format.type"),
])
def test_bad_schemas_are_400s_naming_the_problem(client, model, response_format, message):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=CHAT, max_tokens=4, response_format=response_format)
    assert e.value.status_code == 400
    error = e.value.body
    assert message in error["message"] and error["param"].startswith("response_format")
    assert client.chat.completions.create(model=model, messages=CHAT, max_tokens=2).choices[0].message.content


def test_grpc_matches_http_and_refuses_bad_schemas(srv, client, model):
    name = "nested"
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured=StructuredOutput.from_schema(
        SCHEMAS[name]))
    with Client(srv.target) as c:
        text = "".join(r.text for r in c.generate(None, params, CHAT, 120))
        http = client.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=MAX_TOKENS,
                                              response_format=json_schema(name))
        assert validates(text, SCHEMAS[name]) and text == http.choices[0].message.content
        bad = SamplingParams(structured=StructuredOutput("json_schema", '{"type": "object", "minProperties": "x"}'))
        with pytest.raises(grpc.RpcError) as e:
            list(c.generate(None, bad, CHAT, 60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details() == ("sampling.response_format: unsupported or invalid JSON schema: "
                                     "minProperties must be an integer")
        obj = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured=StructuredOutput("json_object"))
        assert "".join(r.text for r in c.generate(None, obj, CHAT, 120)).startswith("{")


def test_unconstrained_requests_beside_constrained_ones_keep_their_greedy_text(srv):
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["The capital of France is", "Once upon a time"]
    alone = [collect(srv.target, p, greedy).token_ids for p in prompts]
    constrained = SamplingParams(temperature=1.0, seed=3, max_tokens=MAX_TOKENS,
                                 structured=StructuredOutput.from_schema(SCHEMAS["array_of_enums"]))
    got = collect_concurrently(srv.target, [prompts[0], PROMPT, prompts[1], PROMPT],
                               [greedy, constrained, greedy, constrained])
    assert [got[0].token_ids, got[2].token_ids] == alone
    assert all(validates(g.text, SCHEMAS["array_of_enums"]) for g in (got[1], got[3]))
