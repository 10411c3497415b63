"""The one output pipeline (engine/text/answer.py, run by the request processor's
`OutputStream`): a chat's answer on a reasoning model with tools, streamed a token a delta,
comes apart into reasoning, content and tool calls exactly as the whole text does through the
two parsers; an answer that made calls stops with TOOL_CALLS; a raw prompt's text stays whole."""

from __future__ import annotations

import dataclasses
import json

from pdserve.engine.outputs import RequestOutput, TokenDelta
from pdserve.engine.sequence import FinishReason
from pdserve.engine.text.reasoning import ReasoningSplitter
from pdserve.engine.text.tool_parsers import TOOL_FORMATS, ToolCallStream

HERMES = TOOL_FORMATS["hermes"]
ANSWER = ('<think>They ask about Paris.</think>Let me check. '
          '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call> \n')


def _chat(processor, tool_format=HERMES):
    """A chat request whose answer is read in `tool_format` (the test template renders no tools:
    the format is set as `tool_choice` auto would)."""
    request = processor.process(messages=[{"role": "user", "content": "Weather in Paris?"}])
    return dataclasses.replace(request, tool_format=tool_format)


def _stream(processor, request, text: str, reason: FinishReason):
    """`text`'s tokens through the request's OutputStream, one a delta as the engine streams them."""
    stream, output = processor.output_stream(request), RequestOutput("r", request.prompt_token_ids)
    token_ids = processor.tokenizer.encode(text, add_special_tokens=False)
    deltas = [stream.add(TokenDelta("r", (t,), reason if i == len(token_ids) - 1 else None))
              for i, t in enumerate(token_ids)]
    for delta in deltas:
        output.add(delta)
    return deltas, output


def test_a_thinking_chat_with_tools_streams_the_whole_answers_parts(thinking_processor):
    deltas, output = _stream(thinking_processor, _chat(thinking_processor), ANSWER, FinishReason.STOP)
    whole_reasoning = ReasoningSplitter().add(ANSWER, final=True)
    whole_calls = ToolCallStream(HERMES).add(whole_reasoning.content, final=True)
    assert output.text == ANSWER
    assert (output.reasoning, output.content) == (whole_reasoning.reasoning, whole_calls.content)
    assert (output.reasoning, output.content) == ("They ask about Paris.", "Let me check. ")
    assert [(c.name, json.loads(c.arguments)) for c in output.tool_calls] == [("get_weather", {"city": "Paris"})]
    (with_call,) = [d for d in deltas if d.answer.tool_calls]
    assert with_call.answer.num_tool_calls == 1
    assert not any("<" in d.answer.content or "<" in d.answer.reasoning for d in deltas)  # no marker, even in part
    assert deltas[-1].finish_reason is output.finish_reason is FinishReason.TOOL_CALLS


def test_an_answer_cut_by_its_length_keeps_length_and_one_without_calls_stops(thinking_processor):
    _, output = _stream(thinking_processor, _chat(thinking_processor), ANSWER, FinishReason.LENGTH)
    assert output.finish_reason is FinishReason.LENGTH and len(output.tool_calls) == 1
    _, output = _stream(thinking_processor, _chat(thinking_processor), "<think>Easy.</think>Sunny.", FinishReason.STOP)
    assert (output.reasoning, output.content, output.tool_calls) == ("Easy.", "Sunny.", [])
    assert output.finish_reason is FinishReason.STOP


def test_a_raw_prompts_answer_is_all_content(thinking_processor):
    """A raw prompt is the caller's own template: its answer's text as generated, markers and all."""
    request = thinking_processor.process("Weather in Paris?")
    _, output = _stream(thinking_processor, request, ANSWER, FinishReason.STOP)
    assert (output.reasoning, output.content, output.tool_calls) == ("", ANSWER, [])
    assert output.finish_reason is FinishReason.STOP
