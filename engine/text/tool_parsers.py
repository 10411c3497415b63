"""Tool calls in a model family's own text, and back: the parsers that `--tool-call-parser`
names, and the same format as a grammar for answers that must be calls.

A family writes its calls in its own syntax (what its chat template teaches it):

- `hermes` (Qwen2.5/3, Hermes, many fine-tunes): each call a JSON object
  `{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`, several allowed,
  text around them being the answer's content;
- `llama3_json` (Llama 3.1-3.3's JSON tool calling): the whole answer is the calls, JSON
  objects `{"name": ..., "parameters": {...}}` separated by `;`, optionally after `<|python_tag|>`.

`ToolCallStream` reads an answer's text deltas and splits them into content and calls: text
that may still open a call is held back, so no marker reaches the content; a call whose text
does not parse (malformed JSON, no name, arguments that are not an object, a call cut by the
answer's length) is returned as the content it was, never dropped. vLLM's and SGLang's parsers
also stream each call's arguments as they are written; here a call comes out whole once its
text is complete, which is simpler and what clients assemble anyway.

`GENERIC_FORMAT` is pdserve's own, for templates that know no tools (`generic_tools.py`): the
answer is one JSON object, calls or a reply; `ToolCallStream` reads it with `GenericAnswerStream`.

`ToolFormat.structural_tag` is the format as an xgrammar structural tag, for `tool_choice`
`required` or a named function: the answer is then only calls (one, or several with
parallel_tool_calls), each naming an allowed function with arguments that follow its JSON
schema, and the same parser reads it back. The constrained form writes no newlines (every
grammar here refuses tokens with control bytes, `grammar._fill`); the parsers accept both.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.outputs import ToolCall


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """One family's call syntax.

    begin: the markers that open a call region; end: the one that closes it ("": the region
        runs to the end of the answer, and may open only at the answer's start: Llama 3's
        answers are either calls or text).
    arguments_key: what the family names the arguments in a call object (both "arguments"
        and "parameters" are read).
    call_begin/call_separator/call_end: the constrained form, `call_begin` + name +
        `call_arguments` + arguments + `call_end`, calls joined by `call_separator`.
    """

    name: str
    begin: tuple[str, ...]
    end: str
    arguments_key: str
    call_begin: str
    call_separator: str
    call_end: str

    @property
    def call_arguments(self) -> str:
        return f'", "{self.arguments_key}": '

    def parse_region(self, body: str) -> tuple[list[ToolCall], str]:
        """The calls at the start of one region's text (between its markers), and the text after
        the last one that parses (an answer cut by its length ends in a call half written)."""
        decoder, calls, i = json.JSONDecoder(), [], 0
        while True:
            while i < len(body) and (body[i].isspace() or body[i] == ";"):
                i += 1
            try:
                obj, end = decoder.raw_decode(body, i)
            except json.JSONDecodeError:
                return calls, body[i:]
            call = _call(obj)
            if call is None:
                return calls, body[i:]
            calls.append(call)
            i = end

    def structural_tag(self, functions: list[tuple[str, dict[str, Any]]], parallel: bool) -> str:
        """The xgrammar structural tag (JSON text) of answers made only of calls to `functions`
        ((name, parameters schema) pairs), at least one, at most one unless `parallel`."""
        tags = [{"type": "tag", "begin": f"{self.call_begin}{name}{self.call_arguments}",
                 # One blank at most between JSON tokens: a sampled answer cannot ramble in blanks.
                 "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1},
                 "end": self.call_end} for name, schema in functions]
        return json.dumps({"type": "structural_tag", "format": {
            "type": "tags_with_separator", "tags": tags, "separator": self.call_separator, "at_least_one": True,
            "stop_after_first": not parallel}})


def _call(obj: object) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


TOOL_FORMATS: dict[str, ToolFormat] = {
    "hermes": ToolFormat("hermes", begin=("<tool_call>",), end="</tool_call>", arguments_key="arguments",
                         call_begin='<tool_call>{"name": "', call_separator="", call_end="}</tool_call>"),
    "llama3_json": ToolFormat("llama3_json", begin=("<|python_tag|>", "{"), end="", arguments_key="parameters",
                              call_begin='{"name": "', call_separator="; ", call_end="}"),
}

# The generic format's answer is an object, not marked text: `GenericAnswerStream` reads it.
GENERIC_FORMAT = ToolFormat("generic", begin=(), end="", arguments_key="arguments", call_begin="",
                            call_separator="", call_end="")


@dataclass(slots=True)
class ToolCallDelta:
    """What an answer's next text adds: content, and the calls completed by it."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ToolCallStream:
    """One answer's text deltas -> content and calls, in the format `fmt`."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self._pending = ""  # text not yet given out: a possible marker's start, or an open region
        self._in_region: str | None = None  # the marker that opened the current region
        self._plain = False  # the answer is text only (a format whose calls must come first saw text)
        self._texted = False  # the text since the last region holds more than blanks
        self.num_calls = 0
        self._generic = GenericAnswerStream() if fmt is GENERIC_FORMAT else None

    def add(self, text: str, final: bool = False) -> ToolCallDelta:
        if self._generic is not None:
            out = self._generic.add(text, final)
            self.num_calls = self._generic.num_calls
            return out
        self._pending += text
        out = ToolCallDelta()
        while self._pending or final and self._in_region is not None:
            if self._in_region is not None:
                if not self._region(out, final):
                    break
                continue
            if self._plain:
                out.content += self._pending
                self._pending = ""
                break
            if not self._outside(out, final):
                break
        return out

    def _outside(self, out: ToolCallDelta, final: bool) -> bool:
        """Text before a region: content up to a marker (True: a region opened, go on)."""
        fmt = self.fmt
        if not fmt.end:  # a region only at the start, after blanks
            stripped = self._pending.lstrip()
            marker = next((m for m in fmt.begin if stripped.startswith(m)), None)
            if marker is not None:  # a "{" opens the region and is its text's first character
                opener = "" if marker == "{" else marker
                self._pending, self._in_region = stripped[len(opener):], opener
                return True
            if not final and any(m.startswith(stripped) for m in fmt.begin):
                return False  # blanks, or the start of a marker: wait
            self._plain = True
            out.content += self._pending
            self._pending = ""
            return False
        starts = [(i, m) for m in fmt.begin if (i := self._pending.find(m)) >= 0]
        if starts:
            i, marker = min(starts)
            self._content(out, self._pending[:i])
            self._pending, self._in_region = self._pending[i + len(marker):], marker
            return True
        keep = 0 if final else max(_partial_suffix(self._pending, m) for m in fmt.begin)
        text = self._pending[:len(self._pending) - keep]
        if self.num_calls and not self._texted and not text.strip() and not final:
            return False  # blanks after a call: the format's if a call or the end follows, content if text does
        self._content(out, text)
        self._pending = self._pending[len(self._pending) - keep:]
        return False

    def _region(self, out: ToolCallDelta, final: bool) -> bool:
        """An open region: its calls once it closes (True: go on after it)."""
        marker, end = self._in_region, self.fmt.end
        close = self._pending.find(end) if end else -1
        if close < 0 and not final:
            return False
        body = self._pending if close < 0 else self._pending[:close]
        rest = "" if close < 0 else self._pending[close + len(end):]
        calls, unparsed = self.fmt.parse_region(body)
        closing = end if close >= 0 else ""
        if not calls:  # not calls after all: the text as it was
            out.content += f"{marker}{body}{closing}"
        else:
            out.calls += calls
            self.num_calls += len(calls)
            if unparsed:
                out.content += f"{unparsed}{closing}"
        self._pending, self._in_region, self._texted = rest, None, False
        return True

    def _content(self, out: ToolCallDelta, text: str) -> None:
        # Blanks between and after calls are the format's, not content: a stretch of text between
        # regions that is only blanks is dropped whole, however its deltas split it (a streamed
        # answer's content is the whole answer's).
        if self.num_calls and not self._texted and not text.strip():
            return
        self._texted = self._texted or bool(text.strip())
        out.content += text


_REPLY_START = re.compile(r'\s*\{\s*"response"\s*:\s*"')
_CALLS_START = re.compile(r'\s*\{\s*"tool_calls?"')


class GenericAnswerStream:
    """One generic-format answer (`generic_tools.py`) -> content and calls: a reply's text is
    content as it is written (its JSON string decoded piece by piece); calls come once the
    object is complete. An answer cut by its length inside its calls gives neither calls nor
    content (a half-written call is no call, and its JSON is no reply to show a user: the
    finish_reason "length" says why); one that is neither shape (no grammar held it) is the
    text it was."""

    def __init__(self) -> None:
        self._text = ""
        self._reply_at: int | None = None  # where the reply's decoded text has reached in `_text`
        self._reply_done = False
        self.num_calls = 0

    def add(self, text: str, final: bool = False) -> ToolCallDelta:
        self._text += text
        out = ToolCallDelta()
        if self._reply_at is None and (start := _REPLY_START.match(self._text)) is not None:
            self._reply_at = start.end()
        if self._reply_at is not None:
            out.content = self._reply()
        elif final:
            calls = _generic_calls(self._text)
            if calls:
                out.calls, self.num_calls = calls, len(calls)
            elif _CALLS_START.match(self._text) is None:
                out.content = self._text
        return out

    def _reply(self) -> str:
        """The reply's text decoded since the last call: up to its closing quote, or to the last
        complete escape (a surrogate pair's first half waits for its second)."""
        assert self._reply_at is not None
        s, start = self._text, self._reply_at
        i = safe = start
        while i < len(s) and not self._reply_done:
            if s[i] == '"':
                self._reply_done = True
                break
            if s[i] == "\\":
                if s[i + 1:i + 2] == "u":
                    width = 12 if 0xD8 <= _hex_byte(s[i + 2:i + 4]) < 0xDC else 6
                    if i + width > len(s):
                        break
                    i += width
                elif i + 2 > len(s):
                    break
                else:
                    i += 2
            else:
                i += 1
            safe = i
        self._reply_at = safe
        try:
            return json.loads(f'"{s[start:safe]}"')
        except json.JSONDecodeError:  # not the grammar's JSON: the text as written
            return s[start:safe]


def _hex_byte(text: str) -> int:
    try:
        return int(text, 16)
    except ValueError:
        return 0


def _generic_calls(text: str) -> list[ToolCall]:
    """The calls of a complete generic answer ([]: not calls, or one that does not parse)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return []
    if not isinstance(obj, dict):
        return []
    objects = obj.get("tool_calls") if "tool_calls" in obj else [obj.get("tool_call")]
    calls = [_call(o) for o in objects] if isinstance(objects, list) else [None]
    return [c for c in calls if c is not None] if calls and None not in calls else []


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
