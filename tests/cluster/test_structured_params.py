"""`response_format` as both wire formats carry it, to `SamplingParams.structured` and back
(no model: the schema check needs only xgrammar)."""

from __future__ import annotations

import json

import pytest

from pdserve.cluster.api import openai_models as m
from pdserve.cluster.api.grpc_request import sampling_from_proto
from pdserve.cluster.clients.grpc_client import sampling_to_proto
from pdserve.engine.grammar import check_structured
from pdserve.engine.sampling import SamplingParams, StructuredOutput

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"enum": ["x", "y"]}}, "required": ["b"]}


@pytest.mark.parametrize("structured", [None, StructuredOutput("json_object"), StructuredOutput.from_schema(SCHEMA)])
def test_grpc_round_trip(structured):
    params = SamplingParams(temperature=0.5, max_tokens=7, structured=structured)
    assert sampling_from_proto(sampling_to_proto(params)).structured == structured


def test_openai_bodies():
    def parse(response_format: dict) -> StructuredOutput | None:
        body = m.ChatCompletionRequest.model_validate({"messages": [], "response_format": response_format})
        assert body.unsupported() is None
        return body.response_format.structured()

    got = parse({"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}})
    assert got is not None and json.loads(got.json_schema) == SCHEMA
    assert list(json.loads(got.json_schema)["properties"]) == ["b", "a"]  # the output keeps the schema's order
    assert parse({"type": "json_object"}) == StructuredOutput("json_object")
    assert parse({"type": "text"}) is None
    with pytest.raises(ValueError, match="needs json_schema.schema"):
        parse({"type": "json_schema", "json_schema": {"name": "n"}})


@pytest.mark.parametrize("schema, message", [
    ('{"type": "integer", "minimum": "one"}', "Value must be a number"),
    ('{"type": "string", "pattern": "["}', "Regex parsing error"),
    ("3", "object or a boolean"),
])
def test_bad_schemas_name_the_problem(schema, message):
    with pytest.raises(ValueError, match="^response_format: ") as e:
        check_structured(StructuredOutput.from_schema(schema))
    assert message in str(e.value) and "json_schema_converter.cc" not in str(e.value)


def test_structured_output_checks_its_shape():
    with pytest.raises(ValueError, match="needs a schema"):
        StructuredOutput("json_schema")
    with pytest.raises(ValueError, match="unknown type"):
        StructuredOutput("regex", "a+")  # type: ignore[arg-type]
