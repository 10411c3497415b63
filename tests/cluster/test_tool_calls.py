"""Tool calling against a real server (the shared disaggregated one: a tool-capable template,
`--tool-call-parser llama3_json`) through clients nobody here wrote: the official `openai`
client and LangChain's `bind_tools`. Forced (`required`) and named calls sampled at
temperature 1 follow their functions' schemas, streamed and not; `auto` parses the model's own
call (its output steered into Llama 3's call shape by a response_format grammar, which knows
nothing of tools: the parser and the plumbing make it a call) and leaves other JSON as content;
a tool-using history is accepted; bad tool requests are 400s / INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import json

import grpc
import openai
import pytest

from tests.engine.grammar_cases import validates

pytestmark = pytest.mark.slow

WEATHER_ARGS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                 "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"]}
TIME_ARGS = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}, "hour24": {"type": "boolean"}},
             "required": ["tz", "hour24"]}
SCHEMAS = {"get_weather": WEATHER_ARGS, "get_time": TIME_ARGS}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} somewhere", "parameters": schema}}
         for name, schema in SCHEMAS.items()]
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def srv(disaggregated_server):
    return disaggregated_server


def check_call(call, names=tuple(SCHEMAS)) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names and validates(call.function.arguments, SCHEMAS[call.function.name]), call


def streamed(client, model, **body):
    """A streamed chat's content pieces, calls (assembled as clients do: by index) and finish_reason."""
    content, calls, finish = [], {}, None
    for chunk in client.chat.completions.create(model=model, messages=ASK, stream=True, **body):
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        for piece in delta.tool_calls or ():
            call = calls.setdefault(piece.index, {"id": piece.id, "name": piece.function.name, "arguments": ""})
            assert piece.id in (None, call["id"]) and piece.function.name in (None, call["name"])
            call["arguments"] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_required_calls_follow_their_schemas_sampled(client, model):
    one = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, temperature=1.0, seed=3, n=3,
                                         max_tokens=MAX_TOKENS)
    for choice in one.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        check_call(choice.message.tool_calls[0])
    many = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                          temperature=1.0, seed=5, n=2, max_tokens=3 * MAX_TOKENS)
    for choice in many.choices:
        assert choice.message.tool_calls and choice.finish_reason in ("tool_calls", "length")
        for call in choice.message.tool_calls:  # each complete call (a last one cut by length stays text)
            check_call(call)
        ids = [c.id for c in choice.message.tool_calls]
        assert len(set(ids)) == len(ids)


def test_a_named_call_streamed_is_the_whole_answers_call(client, model):
    body = {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}},
            "temperature": 1.0, "seed": 8, "max_tokens": MAX_TOKENS}
    content, calls, finish = streamed(client, model, **body)
    assert "".join(content) == "" and finish == "tool_calls"
    whole = client.chat.completions.create(model=model, messages=ASK, **body).choices[0]
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]  # the same seeded draws
    (call,) = whole.message.tool_calls
    check_call(call, names=("get_time",))


# Llama 3's call shape as a plain JSON schema: the grammar knows nothing of tools.
CALL_SHAPE = {"type": "object", "properties": {"name": {"const": "get_weather"}, "parameters": WEATHER_ARGS},
              "required": ["name", "parameters"]}


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "steer", "schema": schema}}


def test_auto_parses_the_models_own_call_streamed_or_whole(client, model):
    body = {"tools": TOOLS, "temperature": 1.0, "seed": 2, "max_tokens": MAX_TOKENS,
            "response_format": response_format(CALL_SHAPE)}
    whole = client.chat.completions.create(model=model, messages=ASK, **body).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    (call,) = whole.message.tool_calls
    check_call(call, names=("get_weather",))
    content, calls, finish = streamed(client, model, **body)
    assert "".join(content) == "" and finish == "tool_calls"  # no piece of the call's text leaked as content
    assert [(c["name"], c["arguments"]) for c in calls] == [(call.function.name, call.function.arguments)]


def test_auto_leaves_an_answer_that_is_no_call_as_content(client, model):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 8}}, "required": ["answer"]}
    out = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="auto", temperature=0,
                                         max_tokens=MAX_TOKENS, response_format=response_format(schema)).choices[0]
    assert out.message.tool_calls is None and out.finish_reason == "stop"
    assert validates(out.message.content, schema)


def test_a_tool_using_history_is_accepted(client, model):
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_abc", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "Sunny, 21 degrees."}]
    plain = client.chat.completions.create(model=model, messages=ASK, max_tokens=4, temperature=0)
    out = client.chat.completions.create(model=model, messages=history, tools=TOOLS, tool_choice="none",
                                         max_tokens=4, temperature=0)
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content is not None
    assert out.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the tools and the turns were rendered


@pytest.mark.parametrize("body, param, message", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_tide"}}}, "tool_choice",
     "names the function 'get_tide'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "(("}}}}}]},
     "tools[0].function.parameters", "unsupported or invalid JSON schema"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
])
def test_bad_tool_requests_are_400s_naming_the_field(client, model, body, param, message):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=4, **body)
    assert e.value.body["param"] == param and message in e.value.body["message"]
    assert client.chat.completions.create(model=model, messages=ASK, max_tokens=2).choices[0].message.content


def test_grpc_forced_calls_and_refusals(srv):
    from pdserve.proto.v1 import generation_pb2 as pb
    from pdserve.proto.v1 import generation_pb2_grpc as pb_grpc

    tools = [pb.Tool(name=name, parameters=json.dumps(schema)) for name, schema in SCHEMAS.items()]
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=ASK[0]["content"])], tools=tools,
                           tool_choice=pb.ToolChoice(mode="required"), parallel_tool_calls=False)
    request = pb.GenerateRequest(messages=chat, sampling=pb.SamplingParams(temperature=1.0, seed=4,
                                                                           max_tokens=MAX_TOKENS))
    with grpc.insecure_channel(srv.target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        responses = list(stub.Generate(request, timeout=120))
        calls = [c for r in responses for c in r.tool_calls]
        assert responses[-1].finish_reason == pb.FINISH_REASON_TOOL_CALLS and "".join(r.text for r in responses) == ""
        assert len(calls) == 1 and calls[0].id.startswith("call_")
        assert validates(calls[0].arguments, SCHEMAS[calls[0].name])
        request.messages.tool_choice.function = "get_tide"
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request, timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "get_tide" in e.value.details()


def test_langchain_bind_tools(srv, model):
    langchain_openai = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel, Field

    class GetWeather(BaseModel):
        """Weather in a city."""

        city: str = Field(max_length=10)
        unit: str = Field(pattern="^(celsius|fahrenheit)$")

    llm = langchain_openai.ChatOpenAI(model=model, base_url=srv.http_url + "/v1", api_key="unused", temperature=1.0,
                                      max_tokens=MAX_TOKENS, max_retries=0, seed=6)
    for tool_choice in ("GetWeather", "any"):  # named, and LangChain's word for required
        message = llm.bind_tools([GetWeather], tool_choice=tool_choice).invoke(ASK[0]["content"])
        (call,) = message.tool_calls[:1]
        assert call["name"] == "GetWeather" and call["id"].startswith("call_")
        GetWeather.model_validate(call["args"])


# The generic format: a server without --chat-template or --tool-call-parser, on a template that
# renders no tools (the default model's), serves every tool choice (engine/text/generic_tools.py).
@pytest.fixture(scope="module")
def plain(colocated_server):
    with openai.OpenAI(base_url=colocated_server.http_url + "/v1", api_key="unused", max_retries=0,
                       timeout=120) as c:
        yield colocated_server, c


def test_the_generic_format_serves_every_choice_and_a_round_trip(plain):
    _, client = plain
    model = client.models.list().data[0].id
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=1.0,
        seed=3, max_tokens=MAX_TOKENS)
    assert raw.headers["x-pdserve-tool-format"] == "generic"
    first = raw.parse().choices[0]
    assert first.finish_reason == "tool_calls" and first.message.content is None
    (call,) = first.message.tool_calls
    check_call(call)
    history = ASK + [first.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees."}]
    for seed in (1, 2, 3):  # auto: a call that follows its schema, or a reply, never a broken call
        out = client.chat.completions.create(model=model, messages=history, tools=TOOLS, temperature=1.0, seed=seed,
                                             max_tokens=MAX_TOKENS).choices[0]
        if out.message.tool_calls:
            assert out.finish_reason == "tool_calls" and out.message.content is None
            for c in out.message.tool_calls:
                check_call(c)
        else:
            assert out.finish_reason in ("stop", "length") and not (out.message.content or "").startswith('{"')
    body = {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}},
            "temperature": 1.0, "seed": 8, "max_tokens": MAX_TOKENS}
    content, calls, finish = streamed(client, model, **body)
    assert "".join(content) == "" and finish == "tool_calls" and [c["name"] for c in calls] == ["get_time"]
    assert validates(calls[0]["arguments"], TIME_ARGS)
    plain_chat = client.chat.completions.with_raw_response.create(model=model, messages=ASK, max_tokens=2)
    assert "x-pdserve-tool-format" not in plain_chat.headers


def test_langchain_bind_tools_on_the_default_template(plain):
    langchain_openai = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel, Field

    class GetWeather(BaseModel):
        """Weather in a city."""

        city: str = Field(max_length=10)

    srv, client = plain
    llm = langchain_openai.ChatOpenAI(model=client.models.list().data[0].id, base_url=srv.http_url + "/v1",
                                      api_key="unused", temperature=1.0, max_tokens=MAX_TOKENS, max_retries=0, seed=6)
    for tool_choice in ("GetWeather", "any", "required"):
        message = llm.bind_tools([GetWeather], tool_choice=tool_choice).invoke(ASK[0]["content"])
        (call,) = message.tool_calls[:1]
        assert call["name"] == "GetWeather" and call["id"].startswith("call_")
        GetWeather.model_validate(call["args"])
    answer = llm.bind_tools([GetWeather], tool_choice="auto").invoke(ASK[0]["content"])
    assert not answer.invalid_tool_calls
    for call in answer.tool_calls:
        GetWeather.model_validate(call["args"])
