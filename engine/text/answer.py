"""An answer's text deltas -> its parts as the APIs show them: the one place where a
reasoning model's thinking comes apart from its content (reasoning.py) and the content's tool
calls are read out of it (tool_parsers.py), in that order: calls are made in the content,
never in the thinking.

The request processor's `OutputStream` runs an `AnswerParser` on every text delta of a
request, so the gRPC service and the OpenAI API (streamed and whole) render `AnswerDelta`s
and never parse. Both parsers hold back text that may still open a marker, and a streamed
answer's parts, joined, are the whole answer's parsed at once (their tests split texts every
way).
"""

from __future__ import annotations

from pdserve.engine.outputs import AnswerDelta
from pdserve.engine.text.reasoning import ReasoningSplitter
from pdserve.engine.text.tool_parsers import ToolCallStream


class AnswerParser:
    """One answer's text deltas -> `AnswerDelta`s.

    splitter: a chat's answer on a reasoning model (None: no reasoning, all content).
    tool_calls: the request's tool-call format's stream (None: the content has no calls).
    """

    def __init__(self, splitter: ReasoningSplitter | None = None, tool_calls: ToolCallStream | None = None) -> None:
        self._splitter = splitter
        self._tool_calls = tool_calls

    @property
    def num_tool_calls(self) -> int:
        return self._tool_calls.num_calls if self._tool_calls is not None else 0

    def add(self, text: str, final: bool = False) -> AnswerDelta:
        """The parts that `text` completes; `final`: the answer ends with it (nothing held back)."""
        reasoning, content = "", text
        if self._splitter is not None:
            part = self._splitter.add(text, final=final)
            reasoning, content = part.reasoning, part.content
        if self._tool_calls is None:
            return AnswerDelta(reasoning, content)
        calls = self._tool_calls.add(content, final=final)
        return AnswerDelta(reasoning, calls.content, tuple(calls.calls), self.num_tool_calls)
