"""Tools through the request processor (both APIs' bodies): what reaches the chat template,
the forced-call grammar, the history of a tool-using chat, and every bad input refused with a
message naming its field; the default model's template, which cannot render tools, refused
by name with the way out (--chat-template) when the generic format is off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.cluster.api import openai_models as m
from pdserve.cluster.api.grpc_request import parse_request
from pdserve.cluster.api.openai_protocol import chat_choices
from pdserve.engine.text.request_processor import RequestProcessor
from pdserve.engine.text.tool_parsers import TOOL_FORMATS
from pdserve.proto.v1 import generation_pb2 as pb

TOOL_TEMPLATE = Path(__file__).with_name("chatml_tools.jinja")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}}
ASK = {"role": "user", "content": "Weather in Paris?"}
HISTORY = [ASK, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]


@pytest.fixture(scope="module")
def tool_tokenizer(tokenizer):
    """The default tokenizer with a tool-capable template (what --chat-template gives the server)."""
    import copy

    t = copy.deepcopy(tokenizer)
    t.chat_template = TOOL_TEMPLATE.read_text()
    return t


def processor(tokenizer, parser: str = "hermes") -> RequestProcessor:
    return RequestProcessor(tokenizer, "smol", len(tokenizer), 2048, TOOL_FORMATS.get(parser))


def chat(proc: RequestProcessor, **body):
    (choice,) = chat_choices(m.ChatCompletionRequest.model_validate({"max_tokens": 8, **body}), proc)
    return choice.request


def test_the_test_template_renders_plain_chats_as_the_models_own(tokenizer, tool_tokenizer):
    for messages in ([ASK], [{"role": "system", "content": "Be brief."}, ASK, {"role": "assistant", "content": "Hi"},
                             {"role": "user", "content": "More"}]):
        assert (RequestProcessor(tool_tokenizer, "smol", len(tokenizer), 2048).apply_chat_template(messages) ==
                RequestProcessor(tokenizer, "smol", len(tokenizer), 2048).apply_chat_template(messages))


def test_tools_and_history_reach_the_template(tool_tokenizer):
    request = chat(processor(tool_tokenizer), messages=HISTORY, tools=[WEATHER])
    prompt = tool_tokenizer.decode(request.prompt_token_ids)
    assert json.dumps(WEATHER["function"]["parameters"]) in prompt  # the tool, as transformers renders it
    # The history's call with its arguments as an object (templates write them with tojson), and the answer.
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
    assert request.tool_format is TOOL_FORMATS["hermes"] and request.params.structured is None  # auto: free


def test_forced_choices_constrain_the_answer_in_the_parsers_format(tool_tokenizer):
    for parser, begin in (("hermes", "<tool_call>"), ("llama3_json", '{\\"name\\": \\"')):
        request = chat(processor(tool_tokenizer, parser), messages=[ASK], tools=[WEATHER], tool_choice="required",
                       parallel_tool_calls=False)
        assert request.tool_format is TOOL_FORMATS[parser]
        tag = request.params.structured.structural_tag
        assert request.params.structured.kind == "structural_tag" and begin in tag and '"stop_after_first": true' in tag
    named = chat(processor(tool_tokenizer, ""), messages=[ASK], tools=[WEATHER, {"type": "function", "function": {
        "name": "get_time"}}], tool_choice={"type": "function", "function": {"name": "get_time"}})
    tag = json.loads(named.params.structured.structural_tag)
    assert [t["begin"] for t in tag["format"]["tags"]] == ['<tool_call>{"name": "get_time", "arguments": ']
    assert tag["format"]["stop_after_first"]  # a named function: one call, as OpenAI's
    assert named.tool_format is TOOL_FORMATS["hermes"]  # no parser: forced calls in the Hermes format
    none = chat(processor(tool_tokenizer), messages=[ASK], tools=[WEATHER], tool_choice="none")
    assert none.tool_format is None and none.params.structured is None


@pytest.mark.parametrize("body, message", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice names the function 'nope'"),
    ({"tool_choice": "required"}, "tool_choice required needs tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice must be none, auto, required"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "nope"}}}}}]},
     'tools[0].function.parameters: unsupported or invalid JSON schema: Unsupported type "nope"'),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name: 'get_weather' is given twice"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name must be"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type must be function"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format cannot be combined with tool_choice required"),
    ({"messages": [ASK, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "[1]"}}]}]}, "messages[1].tool_calls[0].function.arguments must be a JSON object"),
])
def test_bad_tool_requests_name_the_field(tool_tokenizer, body, message):
    with pytest.raises(ValueError) as e:
        chat(processor(tool_tokenizer), **{"messages": [ASK], **body})
    assert message in str(e.value)


def test_auto_needs_a_parser_and_without_the_generic_format_the_default_template_cannot_render_tools(
        tokenizer, tool_tokenizer):
    with pytest.raises(ValueError, match="tool_choice auto .* needs the server's tool-call parser: start it with "
                                         "--tool-call-parser"):
        chat(processor(tool_tokenizer, ""), messages=[ASK], tools=[WEATHER])
    refusing = RequestProcessor(tokenizer, "smol", len(tokenizer), 2048, generic_tools=False)  # test_generic_tools
    with pytest.raises(ValueError, match="tools: the chat template of model 'smol' does not render tools; start the "
                                         "server with --chat-template PATH"):
        chat(refusing, messages=[ASK], tools=[WEATHER], tool_choice="required")
    with pytest.raises(ValueError, match=r"messages\[1\].tool_calls: the chat template .* does not render tool calls"):
        chat(refusing, messages=HISTORY)


def test_grpc_carries_the_same(tool_tokenizer):
    request = pb.GenerateRequest(messages=pb.ChatMessages(
        messages=[pb.ChatMessage(role="user", content="Weather in Paris?"),
                  pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(id="call_1", name="get_weather",
                                                                           arguments='{"city": "Paris"}')]),
                  pb.ChatMessage(role="tool", content="sunny, 21 C", tool_call_id="call_1")],
        tools=[pb.Tool(name="get_weather", parameters=json.dumps(WEATHER["function"]["parameters"]))],
        tool_choice=pb.ToolChoice(function="get_weather"), parallel_tool_calls=False))
    parsed = parse_request(request, processor(tool_tokenizer))
    prompt = tool_tokenizer.decode(parsed.prompt_token_ids)
    assert '"arguments": {"city": "Paris"}' in prompt and "sunny, 21 C" in prompt
    assert parsed.params.structured.kind == "structural_tag"
    request.messages.tool_choice.function = "nope"
    with pytest.raises(ValueError, match="tool_choice names the function 'nope'"):
        parse_request(request, processor(tool_tokenizer))
