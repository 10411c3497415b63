"""Tools on a template that renders none (the default model's): the generic format. What the
model is told (a system message with the tools), how a history of calls and tool results is
written, the grammar of each tool choice, the answer read back streamed piece by piece, and the
real default model's answers under the grammar: calls that follow their schemas, or a reply."""

from __future__ import annotations

import json

import pytest

from pdserve.cluster.api import openai_models as m
from pdserve.cluster.api.openai_protocol import chat_choices
from pdserve.engine.grammar import StructuredOutputs
from pdserve.engine.text.generic_tools import MAX_PARALLEL_CALLS
from pdserve.engine.text.request_processor import RequestProcessor
from pdserve.engine.text.tool_parsers import GENERIC_FORMAT, ToolCallStream
from tests.engine.grammar_cases import validates

WEATHER_ARGS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}
TIME_ARGS = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER_ARGS}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME_ARGS}}]
ASK = {"role": "user", "content": "What is the weather in Paris?"}
HISTORY = [{"role": "system", "content": "Be brief."}, ASK, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]


def processor(tokenizer, generic: bool = True) -> RequestProcessor:
    return RequestProcessor(tokenizer, "smol", len(tokenizer), 2048, generic_tools=generic)


def chat(proc: RequestProcessor, **body):
    (choice,) = chat_choices(m.ChatCompletionRequest.model_validate({"max_tokens": 8, **body}), proc)
    return choice.request


def schema(request) -> dict:
    assert request.tool_format is GENERIC_FORMAT and request.params.structured.kind == "json_schema"
    return json.loads(request.params.structured.json_schema)


def test_the_tools_are_told_in_a_system_message_and_the_history_in_the_answers_shape(tokenizer):
    request = chat(processor(tokenizer), messages=HISTORY, tools=TOOLS)
    prompt = tokenizer.decode(request.prompt_token_ids)
    system = prompt[:prompt.index(ASK["content"])]
    assert "Be brief." in system and json.dumps(WEATHER_ARGS) in system and '{"response": <your reply>}' in system
    assert '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}' in prompt
    assert '<|im_start|>user\n{"tool_response": {"content": "sunny, 21 C", "tool_call_id": "call_1"}}' in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    # Choice none: no tools told, nothing constrained; the history still renders.
    none = chat(processor(tokenizer), messages=HISTORY, tools=TOOLS, tool_choice="none")
    assert none.tool_format is None and none.params.structured is None
    assert "get_time" not in tokenizer.decode(none.prompt_token_ids)


def test_each_choice_has_its_grammar(tokenizer):
    proc = processor(tokenizer)
    auto = schema(chat(proc, messages=[ASK], tools=TOOLS, parallel_tool_calls=False))
    reply = {"response": "Sunny."}
    call = {"tool_call": {"name": "get_time", "arguments": {"tz": "UTC"}}}
    assert validates(json.dumps(reply), auto) and validates(json.dumps(call), auto)
    assert not validates(json.dumps({"tool_call": {"name": "get_time", "arguments": {"tz": "PST"}}}), auto)
    required = schema(chat(proc, messages=[ASK], tools=TOOLS, tool_choice="required"))
    calls = {"tool_calls": [call["tool_call"], {"name": "get_weather", "arguments": {"city": "Paris"}}]}
    assert validates(json.dumps(calls), required) and not validates(json.dumps(reply), required)
    named = chat(proc, messages=[ASK], tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert validates(json.dumps(call), schema(named))
    assert not validates(json.dumps({"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}),
                         schema(named))
    assert "get_weather" not in tokenizer.decode(named.prompt_token_ids)  # only the named tool is told


def test_parallel_calls_are_bounded_and_one_call_keeps_its_shape(tokenizer):
    """An unbounded array let the default model write calls until its length limit (CI): at
    most MAX_PARALLEL_CALLS, and the one-call shape a history's single call is written in."""
    auto = schema(chat(processor(tokenizer), messages=HISTORY, tools=TOOLS))
    call = {"name": "get_time", "arguments": {"tz": "UTC"}}
    assert validates(json.dumps({"tool_call": call}), auto) and validates(json.dumps({"response": "Hi."}), auto)
    assert validates(json.dumps({"tool_calls": [call] * MAX_PARALLEL_CALLS}), auto)
    assert not validates(json.dumps({"tool_calls": [call] * (MAX_PARALLEL_CALLS + 1)}), auto)
    assert not validates(json.dumps({"tool_calls": []}), auto)
    # The grammar the engine compiles holds the same bound (xgrammar reads maxItems).
    grammar = StructuredOutputs(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    structured = chat(processor(tokenizer), messages=HISTORY, tools=TOOLS).params.structured
    for n, accepted in ((MAX_PARALLEL_CALLS, True), (MAX_PARALLEL_CALLS + 1, False)):
        text = json.dumps({"tool_calls": [call] * n}, separators=(",", ":"))
        assert grammar._new_matcher(structured).accept_string(text) is accepted


def test_refused_when_the_operator_turns_the_fallback_off_or_with_response_format(tokenizer):
    with pytest.raises(ValueError, match="tools: the chat template of model 'smol' does not render tools"):
        chat(processor(tokenizer, generic=False), messages=[ASK], tools=TOOLS, tool_choice="required")
    with pytest.raises(ValueError, match=r"messages\[2\].tool_calls: the chat template .* does not render tool"):
        chat(processor(tokenizer, generic=False), messages=HISTORY)
    with pytest.raises(ValueError, match="response_format cannot be combined with tools"):
        chat(processor(tokenizer), messages=[ASK], tools=TOOLS, response_format={"type": "json_object"})


def streamed(text: str) -> tuple[str, list]:
    """`text` read one character at a time, as the deltas of a streamed answer."""
    stream, content, calls = ToolCallStream(GENERIC_FORMAT), [], []
    for i, ch in enumerate(text):
        delta = stream.add(ch, final=i == len(text) - 1)
        content.append(delta.content)
        calls += delta.calls
    return "".join(content), calls


@pytest.mark.parametrize("reply", ["Sunny, 21 \u00b0C.", 'a "quoted" \\ line\nnext', "emoji \U0001f600 ok", ""])
def test_a_reply_streams_as_its_decoded_text(reply):
    text = json.dumps({"response": reply}, separators=(",", ":"))
    assert streamed(text) == (reply, [])
    stream = ToolCallStream(GENERIC_FORMAT)  # the reply's text comes as it is written, not at the end
    assert stream.add('{"response":"Sunny').content == "Sunny"


def test_calls_come_whole_and_a_cut_call_is_neither_call_nor_text():
    one = '{"tool_call":{"name":"get_weather","arguments":{"city":"Paris"}}}'
    content, calls = streamed(one)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    two = '{"tool_calls":[{"name":"a","arguments":{}},{"name":"b","arguments":{"x":1}}]}'
    assert [c.name for c in streamed(two)[1]] == ["a", "b"]
    for cut in ('{"tool_call":{"name":"get_weather","argu', two[:-3]):
        assert streamed(cut) == ("", [])
    assert streamed("Sunny.") == ("Sunny.", [])  # not the format's JSON (no grammar held it): the text


@pytest.mark.slow
def test_the_default_models_answers_are_calls_or_a_reply(engine, tokenizer):
    proc = processor(tokenizer)
    bodies = [{"tool_choice": "required", "parallel_tool_calls": False, "seed": 1},
              {"tool_choice": {"type": "function", "function": {"name": "get_time"}}, "seed": 2},
              {"tool_choice": "auto", "seed": 3}]
    requests = [chat(proc, messages=[ASK], tools=TOOLS, max_tokens=40, temperature=1.0, **b) for b in bodies]
    outs = engine.generate([r.prompt_token_ids for r in requests], [r.params for r in requests])
    schemas = {"get_weather": WEATHER_ARGS, "get_time": TIME_ARGS}
    for body, out in zip(bodies, outs):
        content, calls = streamed(out.text)
        if body["tool_choice"] != "auto":
            assert content == "" and len(calls) == 1, out.text
        for call in calls:
            assert validates(call.arguments, schemas[call.name]), out.text
        assert calls or out.text.startswith('{"response":"'), out.text  # a call, or a reply read as content
    assert streamed(outs[1].text)[1][0].name == "get_time"
