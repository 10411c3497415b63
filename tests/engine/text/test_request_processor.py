"""The request processor on the default model's tokenizer: every validation error, the chat
template, incremental text, stop strings split across tokens and held back."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from pdserve.engine.outputs import TokenDelta
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.sequence import FinishReason
from pdserve.engine.text.request_processor import OutputStream, RequestProcessor

MAX_MODEL_LEN = 64
OUTPUT = " The answer is forty-two. Next line 🎉 日本語, done."  # an emoji and CJK: multi-token characters


@pytest.fixture(scope="module")
def processor(tokenizer) -> RequestProcessor:
    return RequestProcessor(tokenizer, "smol", len(tokenizer), MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def no_tokenizer() -> RequestProcessor:
    return RequestProcessor(None, "dummy", 100, MAX_MODEL_LEN)


@pytest.mark.parametrize("kwargs, message", [
    ({}, "give one of prompt or messages"),
    ({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, "give one of prompt or messages"),
    ({"prompt": ""}, "prompt is empty"),
    ({"prompt": []}, "prompt is empty"),
    ({"prompt": [], "token_ids_field": "prompt_token_ids"}, "prompt_token_ids is empty"),
    ({"prompt": [1] * MAX_MODEL_LEN}, f"prompt has {MAX_MODEL_LEN} tokens; the context is {MAX_MODEL_LEN} tokens"),
    ({"prompt": "hi " * MAX_MODEL_LEN}, "prompt has"),
    ({"prompt": [5, -1]}, "prompt has token ids [-1] outside the vocabulary [0, 49152)"),
    ({"prompt": [5, 49152], "token_ids_field": "prompt_token_ids"}, "prompt_token_ids has token ids [49152] outside"),
    ({"prompt": [5], "params": SamplingParams(stop_token_ids=(10**9,))}, "unknown stop token ids [1000000000]"),
    ({"messages": []}, "messages is empty"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages has unknown roles ['wizard']"),
    ({"messages": [{"role": "user", "content": "hi " * MAX_MODEL_LEN}]}, "messages has"),
])
def test_bad_requests_name_the_problem(processor, kwargs, message):
    with pytest.raises(ValueError) as err:
        processor.process(**kwargs)
    assert message in str(err.value)


@pytest.mark.parametrize("kwargs, message", [
    ({"prompt": "hi"}, "model 'dummy' has no tokenizer: send token ids"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "has no tokenizer"),
    ({"prompt": [1, 2], "params": SamplingParams(stop=("x",))}, "stop strings need a tokenizer; model 'dummy'"),
])
def test_without_a_tokenizer_only_token_ids_work(no_tokenizer, kwargs, message):
    with pytest.raises(ValueError, match=message):
        no_tokenizer.process(**kwargs)
    request = no_tokenizer.process([1, 2, 3])
    out = no_tokenizer.output_stream(request).add(TokenDelta("r", (4, 5), FinishReason.LENGTH))
    assert (out.token_ids, out.text, out.finish_reason) == ((4, 5), "", FinishReason.LENGTH)


def test_a_tokenizer_without_a_chat_template():
    processor = RequestProcessor(SimpleNamespace(chat_template=None), "plain", 100, MAX_MODEL_LEN)
    with pytest.raises(ValueError, match="model 'plain' has no chat template"):
        processor.process(messages=[{"role": "user", "content": "hi"}])


def test_the_engine_gets_token_ids_and_no_stop_strings(processor, tokenizer):
    params = SamplingParams(temperature=0.5, max_tokens=7, stop=("x", "yz"), stop_token_ids=(13,))
    request = processor.process("Hello there", params=params)
    assert request.prompt_token_ids == tuple(tokenizer.encode("Hello there"))
    assert request.stop == ("x", "yz")
    assert request.params == SamplingParams(temperature=0.5, max_tokens=7, stop_token_ids=(13,))
    assert processor.process([3, 4]).prompt_token_ids == (3, 4)


def test_chat_template(processor, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    ids = processor.process(messages=messages).prompt_token_ids
    text = tokenizer.decode(ids)
    assert text == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "Be brief." in text and "What is 2+2?" in text and text.endswith("<|im_start|>assistant\n")


def _stream(processor, stop: tuple[str, ...] = (), prompt: str = "Question:") -> OutputStream:
    return processor.output_stream(processor.process(prompt, params=SamplingParams(stop=stop)))


@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_text_is_the_decoded_output(processor, tokenizer, chunk):
    ids = tokenizer.encode(OUTPUT)
    stream = _stream(processor)
    texts = []
    for i in range(0, len(ids), chunk):
        last = i + chunk >= len(ids)
        out = stream.add(TokenDelta("r", tuple(ids[i:i + chunk]), FinishReason.LENGTH if last else None))
        assert "\ufffd" not in out.text  # half a character waits for the rest
        texts.append(out.text)
    assert "".join(texts) == tokenizer.decode(ids, skip_special_tokens=True) == OUTPUT


def _first_token_completing(tokenizer, ids: list[int], s: str) -> int:
    return next(i for i in range(len(ids)) if s in tokenizer.decode(ids[:i + 1]))


def test_a_stop_string_split_across_tokens_is_held_back_then_cut(processor, tokenizer):
    ids = tokenizer.encode(OUTPUT)
    stop = "forty-two"  # " forty", "-", "two": three tokens
    at = _first_token_completing(tokenizer, ids, stop)
    stream = _stream(processor, (stop,))
    texts = []
    for i, token_id in enumerate(ids[:at + 1]):
        out = stream.add(TokenDelta("r", (token_id,)))
        texts.append(out.text)
        if i < at:
            assert out.finish_reason is None
            assert "forty" not in "".join(texts)  # it could still become the stop string: held back
    assert out.finish_reason is FinishReason.STOP and out.token_ids == (ids[at],)
    assert "".join(texts) == " The answer is "


def test_a_stop_string_inside_one_delta_drops_the_tokens_after_it(processor, tokenizer):
    ids = tokenizer.encode(OUTPUT)
    at = _first_token_completing(tokenizer, ids, "Next")
    logprobs = tuple(f"lp{i}" for i in range(len(ids)))  # stand-ins: they are cut the same way
    out = _stream(processor, ("Next", "never")).add(TokenDelta("r", tuple(ids), None, logprobs))
    assert out.finish_reason is FinishReason.STOP
    assert out.token_ids == tuple(ids[:at + 1]) and out.logprobs == logprobs[:at + 1]
    assert out.text == " The answer is forty-two. "


def test_held_back_text_comes_out_when_the_request_ends(processor, tokenizer):
    ids = tokenizer.encode(OUTPUT)
    stream = _stream(processor, ("a stop string that never comes",))
    first = stream.add(TokenDelta("r", tuple(ids[:-1])))
    assert len(first.text) < len(tokenizer.decode(ids[:-1]))  # the tail could begin the stop string
    last = stream.add(TokenDelta("r", (ids[-1],), FinishReason.LENGTH))
    assert first.text + last.text == OUTPUT and last.finish_reason is FinishReason.LENGTH


def test_a_stop_string_in_the_prompt_does_not_stop(processor, tokenizer):
    stream = _stream(processor, ("answer",), prompt="The answer")
    out = stream.add(TokenDelta("r", tuple(tokenizer.encode(" is yes")), FinishReason.LENGTH))
    assert out.finish_reason is FinishReason.LENGTH and out.text == " is yes"


def test_importing_it_needs_no_torch():
    code = "import sys, engine.text.request_processor; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[3], timeout=120)
