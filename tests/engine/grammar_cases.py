"""JSON schemas and prompts the structured-output tests share (engine, speculation, HTTP, gRPC).

Strings are bounded (maxLength) and arrays short (maxItems) so that a sampled answer ends
within a few dozen tokens: the grammar ends the request as soon as its JSON is complete.
"""

from __future__ import annotations

import json

import jsonschema

SCHEMAS: dict[str, dict] = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 10},
                               "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}},
                "required": ["city", "zip"],
            },
        },
        "required": ["name", "address"],
    },
    "array_of_enums": {
        "type": "object",
        "properties": {
            "colors": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]},
                       "minItems": 1, "maxItems": 3},
            "count": {"type": "integer", "minimum": 1, "maximum": 3},
        },
        "required": ["colors", "count"],
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "status": {"enum": ["ok", "error"]},
            "age": {"type": "integer", "minimum": 18, "maximum": 65},
            "ok": {"type": "boolean"},
        },
        "required": ["status", "age", "ok"],
    },
}

PROMPT = "Describe a person as a JSON object."
MAX_TOKENS = 48


def validates(text: str, schema: dict) -> bool:
    """Whether `text` is JSON that follows `schema`."""
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True
