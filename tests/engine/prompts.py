"""Deterministic prompts of chosen token lengths for model tests."""

from __future__ import annotations

PASSAGE = (
    "The history of computing is a story of abstraction. Early machines were programmed by rewiring "
    "panels of cables; later, stored programs let a single machine perform many tasks. Compilers "
    "translated human-readable languages into machine code, operating systems shared the hardware "
    "between many users, and networks connected machines across continents. Each layer hid the one "
    "below it, and each made the next possible. Today a language model answers questions, writes "
    "code and summarizes documents, running on accelerators that multiply matrices faster than any "
    "machine of the last century could add two numbers. Behind every answer lies a cache of keys and "
    "values, paged like virtual memory, scheduled one iteration at a time. In the kitchen, a baker "
    "kneads dough for ten minutes, lets it rise for an hour, shapes it into loaves and bakes them until "
    "the crust is golden. The river flows past the old mill, where children once watched the wheel "
    "turn and listened to stories of floods and droughts told by their grandparents. "
)


def prompt_ids(tokenizer, num_tokens: int, variant: int = 0) -> list[int]:
    """A prompt of exactly `num_tokens` tokens; `variant` rotates the passage so prompts differ."""
    words = PASSAGE.split()
    rotated = " ".join(words[variant * 7 % len(words):] + words[:variant * 7 % len(words)])
    ids: list[int] = []
    while len(ids) < num_tokens:
        ids += tokenizer.encode(rotated + " ")
    return ids[:num_tokens]
