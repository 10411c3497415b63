"""The tool-call parsers (`--tool-call-parser`) on fixed model texts: one call, several, none,
malformed, text before the call; whole and streamed (every split of the text gives the same
content and calls, and no marker reaches the content); the forced-call grammar reads back."""

from __future__ import annotations

import json

import pytest

from pdserve.engine.outputs import new_call_id
from pdserve.engine.text.tool_parsers import TOOL_FORMATS, ToolCallStream

HERMES, LLAMA = TOOL_FORMATS["hermes"], TOOL_FORMATS["llama3_json"]
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
TIME = '{"name": "get_time", "arguments": {"tz": "UTC"}}'

# (format, model text, expected content, expected [(name, arguments)])
CASES = [
    (HERMES, f"<tool_call>\n{WEATHER}\n</tool_call>", "", [("get_weather", {"city": "Paris", "days": 2})]),
    (HERMES, f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>", "",
     [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"tz": "UTC"})]),
    (HERMES, f"Let me look.\n<tool_call>{WEATHER}</tool_call>", "Let me look.\n",
     [("get_weather", {"city": "Paris", "days": 2})]),
    (HERMES, "It is sunny in Paris; no <tool> needed.", "It is sunny in Paris; no <tool> needed.", []),
    (HERMES, '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',
     '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>', []),  # malformed: text as it was
    (HERMES, '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),  # no name
    (HERMES, f"<tool_call>\n{WEATHER}", "", [("get_weather", {"city": "Paris", "days": 2})]),  # EOS before </tool_call>
    (HERMES, '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', "", [("f", {"x": 1})]),
    (HERMES, f"<tool_call>{WEATHER}</tool_call> It is 18 C. <tool_call>{TIME}</tool_call> \n", " It is 18 C. ",
     [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"tz": "UTC"})]),  # text between calls, blanks after
    (LLAMA, '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", {"city": "Paris"})]),
    (LLAMA, '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"n": 1}}', "",
     [("a", {}), ("b", {"n": 1})]),
    (LLAMA, "  Paris is sunny.", "  Paris is sunny.", []),
    (LLAMA, '{"name": "get_weather", "parameters": {"city": ', '{"name": "get_weather", "parameters": {"city": ', []),
    (LLAMA, '{"name": "a", "parameters": {}}; {"name": "b", "param', '{"name": "b", "param', [("a", {})]),  # cut short
    (LLAMA, 'Sure: {"name": "f", "parameters": {}}', 'Sure: {"name": "f", "parameters": {}}', []),  # calls come first
    (LLAMA, '{"city": "Paris"}', '{"city": "Paris"}', []),  # JSON, but not a call
]


def _run(fmt, pieces):
    stream = ToolCallStream(fmt)
    content, calls = [], []
    for i, piece in enumerate(pieces):
        part = stream.add(piece, final=i == len(pieces) - 1)
        content.append(part.content)
        calls += part.calls
    return content, [(c.name, json.loads(c.arguments)) for c in calls], calls


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_whole_and_streamed_alike(fmt, text, content, calls):
    got_content, got_calls, _ = _run(fmt, [text])
    assert ("".join(got_content), got_calls) == (content, calls)
    for size in (1, 2, 5):  # every split: the same answer, and no marker of a call in any content piece
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        got_content, got_calls, _ = _run(fmt, pieces)
        assert ("".join(got_content), got_calls) == (content, calls), size
        markers = ("<tool_call", '{"name')
        if not any(marker in content for marker in markers):  # a call's text is never content, even in part
            assert not any(marker in piece for piece in got_content for marker in markers)


def test_text_before_a_call_streams_before_it_completes():
    stream = ToolCallStream(HERMES)
    assert stream.add("I will check. <tool").content == "I will check. "  # "<tool" may open a call: held
    assert stream.add("_call>" + WEATHER).content == ""
    part = stream.add("</tool_call>")
    assert [c.name for c in part.calls] == ["get_weather"] and stream.num_calls == 1
    assert stream.add(" <b>", final=True).content == " <b>"


def test_calls_carry_fresh_openai_style_ids():
    _, _, calls = _run(HERMES, [f"<tool_call>{WEATHER}</tool_call><tool_call>{WEATHER}</tool_call>"])
    ids = [c.id for c in calls] + [new_call_id()]
    assert len(set(ids)) == 3 and all(i.startswith("call_") and len(i) == 29 and i[5:].isalnum() for i in ids)


@pytest.mark.parametrize("fmt", [HERMES, LLAMA])
@pytest.mark.parametrize("parallel", [True, False])
def test_the_forced_grammar_accepts_what_the_parser_reads_and_nothing_else(tokenizer, fmt, parallel):
    """The structural tag's answers, checked by xgrammar's matcher on the default tokenizer's
    tokens, are the calls the parser reads back; one call only without parallel_tool_calls."""
    import xgrammar as xgr

    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tag = fmt.structural_tag([("get_weather", schema), ("get_time", {"type": "object", "properties": {}})], parallel)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiled = xgr.GrammarCompiler(info).compile_structural_tag(tag)

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        return all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) and \
            matcher.is_completed()

    one = f'{fmt.call_begin}get_weather{fmt.call_arguments}{{"city": "Paris"}}{fmt.call_end}'
    two = one + fmt.call_separator + f"{fmt.call_begin}get_time{fmt.call_arguments}{{}}{fmt.call_end}"
    assert accepts(one)
    assert accepts(two) == parallel
    assert not accepts(one.replace('"Paris"', "7"))  # arguments off their schema
    assert not accepts(one.replace("get_weather", "get_wether"))  # an unknown function
    assert not accepts("It is sunny.")  # no call at all
    _, calls, _ = _run(fmt, [two if parallel else one])
    assert calls == [("get_weather", {"city": "Paris"})] + ([("get_time", {})] if parallel else [])
