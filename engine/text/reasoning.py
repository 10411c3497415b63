"""A reasoning model's answer split into its reasoning and its content, as OpenAI-compatible
servers return them (`reasoning_content` beside `content`; vLLM's and SGLang's reasoning
parsers for Qwen3 and DeepSeek-R1).

A model thinks between `<think>` and `</think>` (single tokens of its vocabulary: Qwen3,
QwQ, DeepSeek-R1). The reasoning starts either with a `<think>` the model writes first, or
in the prompt: a chat template that ends the prompt with an open `<think>` (thinking
models whose template opens it). Everything up to `</think>` is reasoning, the rest is
content; an answer without the markers is all content. Markers are never returned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

THINK_START, THINK_END = "<think>", "</think>"


def thinks(tokenizer: Any | None) -> bool:
    """Whether the model's vocabulary has the two markers as tokens of their own."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return False
    vocab = get_vocab()
    return THINK_START in vocab and THINK_END in vocab


def opens_thinking(prompt_text: str) -> bool:
    """Whether a prompt leaves the model inside its reasoning (its last marker is an open one)."""
    return prompt_text.rfind(THINK_START) > prompt_text.rfind(THINK_END)


@dataclass(slots=True)
class ReasoningDelta:
    reasoning: str
    content: str


class ReasoningSplitter:
    """One answer's text deltas -> (reasoning, content) deltas. Text that could still be the
    start of a marker is held back until it cannot (or the answer ends)."""

    def __init__(self, in_reasoning: bool = False) -> None:
        self._in_reasoning = in_reasoning
        self._started = in_reasoning  # a <think> is only honoured at the start of the answer
        self._pending = ""

    def add(self, text: str, final: bool = False) -> ReasoningDelta:
        self._pending += text
        out = ReasoningDelta("", "")
        while self._pending:
            if not self._started:
                stripped = self._pending.lstrip()
                if stripped.startswith(THINK_START):
                    self._pending, self._in_reasoning, self._started = stripped[len(THINK_START):], True, True
                    continue
                if THINK_START.startswith(stripped) and not final:
                    break  # could still become <think>
                self._started = True
            if not self._in_reasoning:
                out.content += self._pending
                self._pending = ""
                break
            end = self._pending.find(THINK_END)
            if end >= 0:
                out.reasoning += self._pending[:end]
                self._pending, self._in_reasoning = self._pending[end + len(THINK_END):], False
                continue
            keep = 0 if final else _partial_suffix(self._pending, THINK_END)
            out.reasoning += self._pending[:len(self._pending) - keep]
            self._pending = self._pending[len(self._pending) - keep:]
            break
        return out


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
