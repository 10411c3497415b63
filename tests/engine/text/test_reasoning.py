"""A reasoning model's answer split into reasoning and content (engine/text/reasoning.py), and the
chat template's own variables (`chat_template_kwargs`) on a tokenizer that thinks (conftest.py's
`thinking_processor`: thinking on unless `enable_thinking` is false)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.cluster.api import openai_models as m
from pdserve.cluster.api.openai_protocol import ChatRenderer, chat_choices
from pdserve.engine.outputs import TokenDelta
from pdserve.engine.sequence import FinishReason
from pdserve.engine.text.reasoning import ReasoningSplitter
from pdserve.engine.text.request_processor import RequestProcessor


def _split(chunks: list[str], in_reasoning: bool = False) -> tuple[str, str]:
    splitter, reasoning, content = ReasoningSplitter(in_reasoning), "", ""
    for i, chunk in enumerate(chunks):
        part = splitter.add(chunk, final=i == len(chunks) - 1)
        reasoning, content = reasoning + part.reasoning, content + part.content
    return reasoning, content


@pytest.mark.parametrize(("text", "in_reasoning", "want"), [
    ("<think>\nLet me see.\n</think>\n\nForty-two.", False, ("\nLet me see.\n", "\n\nForty-two.")),
    ("  <think>a</think>b", False, ("a", "b")),
    ("Forty-two.", False, ("", "Forty-two.")),
    ("Let me see.</think>Forty-two.", True, ("Let me see.", "Forty-two.")),  # the prompt opened it
    ("Still thinking", True, ("Still thinking", "")),  # cut off (max_tokens) inside the reasoning
    ("<thi", False, ("", "<thi")),
    ("x <think>y</think>", False, ("", "x <think>y</think>")),  # a marker later in the answer is text
])
def test_an_answer_splits_into_reasoning_and_content(text, in_reasoning, want):
    assert _split([text], in_reasoning) == want


@given(st.lists(st.integers(0, 60), max_size=8), st.booleans())
def test_any_chunking_of_the_stream_gives_the_whole_answers_split(cuts, in_reasoning):
    text = "<think>\nHmm, 6 x 7 </thin no: </think>\n\nIt is 42 <think> as said."
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])] or [text]
    assert _split(chunks, in_reasoning) == _split([text], in_reasoning)


def test_chat_template_kwargs_reach_the_template(thinking_processor):
    messages = [{"role": "user", "content": "What is 6 x 7?"}]
    thinking = thinking_processor.process(messages=messages).prompt_token_ids
    plain = thinking_processor.process(messages=messages, chat_template_kwargs={"enable_thinking": False})
    decode = thinking_processor.tokenizer.decode
    assert decode(list(plain.prompt_token_ids)).endswith("assistant\n<think>\n\n</think>\n\n")
    assert decode(list(thinking)).endswith("assistant\n")
    with pytest.raises(ValueError, match=r"chat_template_kwargs may not set \['tokenize'\]"):
        thinking_processor.process(messages=messages, chat_template_kwargs={"tokenize": True})


def test_a_thinking_answer_comes_back_as_reasoning_content_streamed_or_whole(thinking_processor):
    tokenizer = thinking_processor.tokenizer
    request = m.ChatCompletionRequest(messages=[m.ChatMessage(role="user", content="What is 6 x 7?")], max_tokens=40)
    (choice,) = chat_choices(request, thinking_processor)
    answer = tokenizer.encode("<think>Six sevens.</think>It is 42.", add_special_tokens=False)
    renderer = ChatRenderer(thinking_processor, "chatcmpl-1", 0, "thinker")
    stream = thinking_processor.output_stream(choice.request)
    chunks = []
    for i, token_id in enumerate(answer):  # one token a delta, as the engine streams them
        reason = FinishReason.LENGTH if i == len(answer) - 1 else None
        delta = stream.add(TokenDelta(choice.output.request_id, (token_id,), reason))
        choice.output.add(delta)
        chunks.append(renderer.chunks(choice, delta)[0].choices[0].delta)
    assert "".join(c.reasoning_content or "" for c in chunks) == "Six sevens."
    assert "".join(c.content or "" for c in chunks) == "It is 42."
    message = renderer.response([choice]).choices[0].message
    assert (message.reasoning_content, message.content) == ("Six sevens.", "It is 42.")


def test_a_model_without_the_markers_answers_in_content_only(tokenizer):
    assert RequestProcessor(tokenizer, "smol", len(tokenizer), 64).reasoning_splitter([1, 2, 3]) is None
    assert RequestProcessor(None, "dummy", 100, 64).reasoning_splitter([1, 2, 3]) is None


def test_grpc_takes_chat_template_kwargs_and_streams_the_reasoning_apart(thinking_processor):
    """pdserve.v1's chat input carries the template's variables (a Struct), and its responses
    the thinking apart from the answer (`reasoning`, `text`), chunk by chunk."""
    from google.protobuf import struct_pb2

    from pdserve.cluster.api.grpc_request import parse_request
    from pdserve.cluster.api.grpc_service import GenerationService
    from pdserve.cluster.serving.coordinator import RequestReport
    from pdserve.proto.v1 import generation_pb2 as pb

    kwargs = struct_pb2.Struct()
    kwargs.update({"enable_thinking": False})
    chat = [pb.ChatMessage(role="user", content="What is 6 x 7?")]
    plain = parse_request(pb.GenerateRequest(messages=pb.ChatMessages(messages=chat, chat_template_kwargs=kwargs)),
                          thinking_processor)
    decode = thinking_processor.tokenizer.decode
    assert decode(list(plain.prompt_token_ids)).endswith("assistant\n<think>\n\n</think>\n\n")
    request = parse_request(pb.GenerateRequest(messages=pb.ChatMessages(messages=chat)), thinking_processor)
    assert decode(list(request.prompt_token_ids)).endswith("assistant\n")

    answer = thinking_processor.tokenizer.encode("<think>Six sevens.</think>It is 42.", add_special_tokens=False)
    stream = thinking_processor.output_stream(request)
    responses = []
    for i, token_id in enumerate(answer):
        reason = FinishReason.LENGTH if i == len(answer) - 1 else None
        delta = stream.add(TokenDelta("r", (token_id,), reason))
        responses.append(GenerationService._response("r", delta, 10, i + 1, RequestReport()))
    assert "".join(r.reasoning for r in responses) == "Six sevens."
    assert "".join(r.text for r in responses) == "It is 42."
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
