"""Tool calls on a model whose chat template knows no tools (the default model's): the generic
format, as llama.cpp's server serves such templates.

- The prompt: the tools and the answer's shape are described in a system message pdserve adds
  (merged into the chat's own system message, first); a history's assistant `tool_calls` are
  written in the answer's own shape and its `tool` turns as user turns holding a
  `{"tool_response": ...}` object, which any template renders.
- The answer: one JSON object, constrained by a grammar to either calls or a reply:
  `{"tool_call": {"name": ..., "arguments": {...}}}` (with parallel_tool_calls, also
  `{"tool_calls": [...]}` of at most MAX_PARALLEL_CALLS) or `{"response": "..."}`. `required`
  and a named function leave only the calls (to that function), `auto` both; `none` describes
  no tools and constrains nothing. The array is bounded because a small model at temperature 1
  may never pick its closing `]` over one more call (the default model did, until its length
  limit, CI of 2026-12-06); the one-call shape stays open with parallel calls since a history's
  single call is written in it and the model follows its own history.
- Reading it back: `GenericAnswerStream` (`tool_parsers.py`) streams a reply's text as content
  as it is written, and gives the calls once the object is complete.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from pdserve.engine.sampling import StructuredOutput
from pdserve.engine.text.tools import Function, ToolRequest

REPLY_KEY = "response"
CALL_KEY = "tool_call"
CALLS_KEY = "tool_calls"
MAX_PARALLEL_CALLS = 8


def _allowed(tools: ToolRequest) -> list[Function]:
    """The functions the answer may call: all, or the one a named choice names."""
    return [f for f in tools.functions if tools.choice != "function" or f.name == tools.function_name]


def _parallel(tools: ToolRequest) -> bool:
    return tools.parallel and tools.choice != "function"


def answer_schema(tools: ToolRequest) -> dict[str, Any]:
    """The JSON schema of the answer: calls to the allowed functions, or (auto) a reply."""
    call = {"anyOf": [{"type": "object", "properties": {"name": {"const": f.name},
                                                         "arguments": json.loads(f.parameters)},
                       "required": ["name", "arguments"]} for f in _allowed(tools)]}
    calls: dict[str, Any] = {"type": "object", "properties": {CALL_KEY: call}, "required": [CALL_KEY]}
    if _parallel(tools):
        array = {"type": "array", "items": call, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS}
        calls = {"anyOf": [calls, {"type": "object", "properties": {CALLS_KEY: array}, "required": [CALLS_KEY]}]}
    if tools.forced:
        return calls
    reply = {"type": "object", "properties": {REPLY_KEY: {"type": "string"}}, "required": [REPLY_KEY]}
    return {"anyOf": [calls, reply]}


def structured(tools: ToolRequest) -> StructuredOutput:
    return StructuredOutput.from_schema(answer_schema(tools))


def system_prompt(tools: ToolRequest) -> str:
    """What the model is told of the tools and of the answer's shape."""
    described = [f.template_tool()["function"] for f in _allowed(tools)]
    call = '{"tool_call": {"name": <tool name>, "arguments": <its arguments>}}'
    if _parallel(tools):
        call += (f' (or, for several calls at once, at most {MAX_PARALLEL_CALLS}: '
                 '{"tool_calls": [{"name": <tool name>, "arguments": <its arguments>}, ...]})')
    if tools.choice == "function":
        how = f"Call the tool {tools.function_name} with one JSON object: {call}"
    elif tools.forced:
        how = f"Call one or more of them with one JSON object: {call}"
    else:
        how = (f"Answer with one JSON object: either {call} to call tools, or "
               '{"response": <your reply>} to reply to the user.')
    return f"You can use these tools:\n{json.dumps(described, ensure_ascii=False)}\n{how}"


def generic_messages(messages: Sequence[Mapping[str, Any]], tools: ToolRequest | None) -> list[dict[str, Any]]:
    """`messages` for a template without tools: the tools' system message (unless no tools or
    choice none), assistant calls as the answer's JSON and tool turns as user turns."""
    out: list[dict[str, Any]] = []
    for message in messages:
        message = dict(message)
        if message.get("role") == "assistant" and message.get("tool_calls"):
            message["content"] = _calls_text(message.pop("tool_calls"), message.get("content"))
        elif message.get("role") == "tool":
            response = {"content": message.get("content") or ""}
            if message.get("tool_call_id"):
                response["tool_call_id"] = message["tool_call_id"]
            message = {"role": "user", "content": json.dumps({"tool_response": response}, ensure_ascii=False)}
        out.append(message)
    if tools is None or tools.choice == "none" or not tools.functions:
        return out
    prompt = system_prompt(tools)
    if out and out[0].get("role") == "system":
        out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{prompt}".lstrip()}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out


def _calls_text(tool_calls: Sequence[Mapping[str, Any]], content: str | None) -> str:
    """A history's calls in the answer's shape (arguments as objects: the request processor's
    caller made them so, or they are JSON text); the turn's own text is kept before them."""
    calls = []
    for call in tool_calls:
        function = call.get("function", call)
        arguments = function.get("arguments", {})
        calls.append({"name": function.get("name"),
                      "arguments": json.loads(arguments) if isinstance(arguments, str) else arguments})
    text = json.dumps({CALLS_KEY: calls} if len(calls) > 1 else {CALL_KEY: calls[0]}, ensure_ascii=False)
    return f"{content}\n{text}" if content else text
