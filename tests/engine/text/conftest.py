"""A request processor that thinks: the default model's tokenizer with Qwen3's `<think>` /
`</think>` added as tokens and a Qwen3-style chat template (thinking on unless
`enable_thinking` is false)."""

from __future__ import annotations

import pytest

from pdserve.engine.text.request_processor import RequestProcessor

QWEN3_STYLE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="session")
def thinking_processor(model_folder) -> RequestProcessor:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_folder))
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = QWEN3_STYLE
    return RequestProcessor(tokenizer, "thinker", len(tokenizer), 4096)
