"""A request is validated once, where it enters: the gRPC frontend checks its sampling
fields (to name them `sampling.*`) and the request processor does not check them again,
unless a forced tool choice gives the request a grammar of its own; what it builds for the
workers passes their integrity check."""

from __future__ import annotations

import json

import pytest

from pdserve.cluster.api.grpc_request import parse_request
from pdserve.engine.messages import WorkerRequest
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.text.request_processor import RequestProcessor
from pdserve.engine.text.tools import tool_request
from pdserve.proto.v1 import generation_pb2 as pb

MAX_MODEL_LEN = 2048
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.fixture
def checks(monkeypatch) -> list:
    """Every schema check (`grammar.check_structured`), recorded."""
    import pdserve.engine.grammar as grammar

    calls: list = []
    check = grammar.check_structured
    monkeypatch.setattr(grammar, "check_structured", lambda s: (calls.append(s), check(s))[1])
    return calls


@pytest.fixture(scope="module")
def processor(tokenizer) -> RequestProcessor:
    return RequestProcessor(tokenizer, "smol", len(tokenizer), MAX_MODEL_LEN)


def _request(**sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(
        response_format=pb.ResponseFormat(json_schema=json.dumps(SCHEMA)), **sampling))


def test_a_grpc_request_s_schema_is_checked_once(processor, checks):
    parsed = parse_request(_request(max_tokens=8), processor)
    assert len(checks) == 1 and parsed.params.structured is not None
    WorkerRequest("w", parsed.prompt_token_ids, parsed.params).check(processor.vocab_size, MAX_MODEL_LEN, True)


def test_a_bad_schema_is_still_named_in_the_sampling_fields(processor, checks):
    request = pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(
        response_format=pb.ResponseFormat(json_schema='{"type": "nope"}')))
    with pytest.raises(ValueError, match=r"^sampling\.response_format: unsupported or invalid JSON schema"):
        parse_request(request, processor)
    assert len(checks) == 1


def test_a_forced_tool_choice_s_grammar_is_checked_after_the_params(processor, checks):
    tools = tool_request([{"type": "function", "function": {"name": "get_time", "parameters": SCHEMA}}],
                         "required", None)
    processed = processor.process("Hi", params=SamplingParams(), tools=tools, params_checked=True)
    assert processed.params.structured is not None and processed.params.structured.kind == "structural_tag"
    assert [s.kind for s in checks] == ["structural_tag"]
