"""Every field the official `openai` client can send to /v1/completions and
/v1/chat/completions is known to the request bodies: implemented, accepted because it changes
nothing a self-hosted server returns, or accepted only at its neutral value and refused by
name otherwise (issue 38: nothing that changes the output is dropped in silence)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from pdserve.cluster.api import openai_models as m

BODIES = [(m.CompletionRequest, completion_create_params.CompletionCreateParamsBase, {"prompt": "hi"}),
          (m.ChatCompletionRequest, chat_create_params.CompletionCreateParamsBase, {"messages": []})]


@pytest.mark.parametrize("body, client_params, required", BODIES)
def test_every_field_the_official_client_sends_is_known(body, client_params, required):
    unknown = set(client_params.__annotations__) - set(body.model_fields)
    assert not unknown, f"{body.__name__} would drop {sorted(unknown)} in silence"


@pytest.mark.parametrize("body, client_params, required", BODIES)
def test_neutral_values_pass_and_any_other_value_is_refused_by_name(body, client_params, required):
    assert body.model_validate(required).unsupported() is None
    for name, neutral in body.NEUTRAL_ONLY.items():
        for value in neutral:
            assert body.model_validate({**required, name: value}).unsupported() is None, (name, value)
    changed = {"prompt_logprobs": 0, "echo": True, "suffix": "!",
               "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
               "functions": [{"name": "f"}], "function_call": {"name": "f"}, "modalities": ["text", "audio"],
               "audio": {"voice": "alloy", "format": "wav"}, "prediction": {"type": "content", "content": "x"},
               "reasoning_effort": "low", "verbosity": "high", "web_search_options": {},
               "moderation": {"input": {"mode": "block"}}}
    for name in body.NEUTRAL_ONLY:
        assert body.model_validate({**required, name: changed[name]}).unsupported() == name


@pytest.mark.parametrize("body, client_params, required", BODIES)
def test_fields_that_change_nothing_here_are_accepted(body, client_params, required):
    ignored = {"user": "u1", "metadata": {"k": "v"}, "store": True, "service_tier": "flex",
               "prompt_cache_key": "k", "safety_identifier": "s"}
    if body is m.ChatCompletionRequest:
        ignored |= {"parallel_tool_calls": False, "prompt_cache_retention": "24h", "prompt_cache_options": {}}
    ignored = {k: v for k, v in ignored.items() if k in body.model_fields}
    assert body.model_validate({**required, **ignored}).unsupported() is None


@pytest.mark.parametrize("body, client_params, required", BODIES)
def test_penalties_bias_and_min_tokens_are_carried_to_the_sampling_params(body, client_params, required):
    from pdserve.cluster.api.openai_protocol import _sampling

    req = body.model_validate({**required, "frequency_penalty": 0.5, "presence_penalty": -1.0,
                               "logit_bias": {"11": 5.0, "7": -100}, "repetition_penalty": 1.3, "min_tokens": 4})
    assert req.unsupported() is None
    params = _sampling(req, 16, None)
    assert (params.frequency_penalty, params.presence_penalty, params.repetition_penalty, params.min_tokens) == (
        0.5, -1.0, 1.3, 4)
    assert params.logit_bias == ((7, -100.0), (11, 5.0))
    assert _sampling(body.model_validate({**required, "frequency_penalty": None}), 16, None).penalized is False


def test_best_of_is_only_n():
    assert m.CompletionRequest.model_validate({"prompt": "x", "n": 2, "best_of": 2}).unsupported() is None
    assert m.CompletionRequest.model_validate({"prompt": "x", "best_of": 3}).unsupported() == "best_of"


def test_the_bodies_and_their_protocol_import_no_torch():
    code = ("import sys, pdserve.cluster.api.openai_protocol; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("body, client_params, required", BODIES)
def test_priority_is_an_integer_carried_to_the_sampling_params(body, client_params, required):
    from pydantic import ValidationError

    from pdserve.cluster.api.openai_protocol import _sampling

    assert _sampling(body.model_validate(required), 16, None).priority == 0  # vLLM's default
    assert _sampling(body.model_validate({**required, "priority": -3}), 16, None).priority == -3
    for bad in ("1", 1.5, 2.0, True, None):
        with pytest.raises(ValidationError) as e:
            body.model_validate({**required, "priority": bad})
        assert e.value.errors()[0]["loc"] == ("priority",), bad
