"""Incremental detokenization with stop strings."""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes only a short window (as vLLM does): the text of tokens
    [prefix_offset:] minus that of [prefix_offset:read_offset]. A window
    ending in an incomplete UTF-8 character ("\\ufffd") waits for more tokens.
    Text that could still become a stop string is held back until it cannot.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int] | tuple[int, ...], stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._ids: list[int] = list(prompt_token_ids[-6:])  # context for tokenizers that merge spaces
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""
        self._emitted = 0

    def add(self, token_id: int) -> bool:
        """Append one token; returns True when a stop string appeared (text is cut before it)."""
        self._ids.append(token_id)
        prefix = self.tokenizer.decode(self._ids[self._prefix_offset:self._read_offset], skip_special_tokens=True)
        full = self.tokenizer.decode(self._ids[self._prefix_offset:], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False
        searched_from = max(0, len(self.text) - self._holdback)
        self.text += full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        for s in self.stop:
            at = self.text.find(s, searched_from)
            if at != -1:
                self.text = self.text[:at]
                return True
        return False

    def take_delta(self, finished: bool) -> str:
        """Text not yet returned; while unfinished, keeps back what may start a stop string."""
        end = len(self.text) if finished else max(self._emitted, len(self.text) - self._holdback)
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta
