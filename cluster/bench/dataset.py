"""What `pdserve bench` sends: random token-id prompts of given lengths, or a JSONL dataset.

A JSONL line is {"prompt": "..."} or {"messages": [{"role": ..., "content": ...}, ...]},
optionally with "output_len". `synthetic_chat.jsonl` beside this module is a small
chat-shaped set (written by `python -m pdserve.cluster.bench.dataset`, seeded, no
real data) that runs anywhere.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

SYNTHETIC_CHAT = Path(__file__).with_name("synthetic_chat.jsonl")
_ID_MARGIN = 10  # random ids stay clear of the vocabulary's ends (special tokens sit there)


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request: exactly one of prompt_ids, prompt, messages."""

    output_len: int
    prompt_ids: tuple[int, ...] | None = None
    prompt: str | None = None
    messages: tuple[dict[str, str], ...] | None = None

    @property
    def input_len(self) -> int | None:
        """Prompt tokens when known before sending (token-id prompts); else the server's count."""
        return len(self.prompt_ids) if self.prompt_ids is not None else None


def random_requests(num: int, input_len: int, output_len: int, vocab_size: int, range_ratio: float = 0.0,
                    seed: int = 0) -> list[BenchRequest]:
    """`num` prompts of random ids; lengths uniform in [len * (1 - range_ratio), len * (1 + range_ratio)]."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1:
        raise ValueError(f"input and output lengths must be positive, got {input_len} and {output_len}")
    if vocab_size <= 2 * _ID_MARGIN:
        raise ValueError(f"vocabulary of {vocab_size} is too small for random prompts")
    rng = random.Random(seed)

    def length(n: int) -> int:
        return max(1, rng.randint(int(n * (1 - range_ratio)), int(n * (1 + range_ratio))))

    return [BenchRequest(output_len=length(output_len), prompt_ids=random_ids(rng, length(input_len), vocab_size))
            for _ in range(num)]


def random_ids(rng: random.Random, num: int, vocab_size: int) -> tuple[int, ...]:
    """`num` random token ids clear of the vocabulary's ends."""
    if vocab_size <= 2 * _ID_MARGIN:
        raise ValueError(f"vocabulary of {vocab_size} is too small for random prompts")
    return tuple(rng.randrange(_ID_MARGIN, vocab_size - _ID_MARGIN) for _ in range(num))


def jsonl_requests(path: Path, num: int, output_len: int | None = None, seed: int = 0,
                   default_output_len: int = 128) -> list[BenchRequest]:
    """`num` requests drawn from a JSONL file (cycled when it is shorter, shuffled by `seed`).
    Answer lengths: `output_len` when given, else each line's own, else `default_output_len`."""
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not JSON: {e}") from None
        if not isinstance(row, dict) or ("prompt" in row) == ("messages" in row):
            raise ValueError(f"{path}:{lineno}: a line needs exactly one of 'prompt' and 'messages'")
        n = output_len or int(row.get("output_len", default_output_len))
        if "prompt" in row:
            rows.append(BenchRequest(output_len=n, prompt=str(row["prompt"])))
        else:
            messages = tuple({"role": str(m["role"]), "content": str(m["content"])} for m in row["messages"])
            rows.append(BenchRequest(output_len=n, messages=messages))
    if not rows:
        raise ValueError(f"{path}: no requests")
    random.Random(seed).shuffle(rows)
    return [rows[i % len(rows)] for i in range(num)]


_TOPICS = ("the water cycle", "binary search", "a sourdough starter", "TCP congestion control", "photosynthesis",
           "the French revolution", "garbage collection", "a budget for a small café", "black holes",
           "unit testing", "the rules of chess", "compound interest", "how vaccines work", "a haiku about rain",
           "paged attention", "the history of the bicycle", "public-key cryptography", "composting at home")
_ASKS = ("Explain {t} to a twelve-year-old.", "Give three surprising facts about {t}.",
         "Write a short, friendly paragraph about {t}.", "What are common mistakes people make with {t}?",
         "Summarize {t} in five bullet points.", "Compare {t} with something from everyday life.")


def write_synthetic_chat(path: Path = SYNTHETIC_CHAT, num: int = 200, seed: int = 0) -> None:
    """The shipped chat-shaped set: single- and multi-turn conversations from templates."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num):
        topic = rng.choice(_TOPICS)
        messages = [{"role": "system", "content": "You are a helpful assistant."}] if rng.random() < 0.5 else []
        messages.append({"role": "user", "content": rng.choice(_ASKS).format(t=topic)})
        if rng.random() < 0.3:  # a second turn
            messages.append({"role": "assistant", "content": f"Here is a short overview of {topic}."})
            messages.append({"role": "user", "content": rng.choice(_ASKS).format(t=rng.choice(_TOPICS))})
        lines.append(json.dumps({"messages": messages, "output_len": rng.choice((32, 64, 128, 256))}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    write_synthetic_chat()
