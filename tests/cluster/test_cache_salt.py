"""`cache_salt` as both wire formats carry it, to `SamplingParams.cache_salt` (no model)."""

from __future__ import annotations

import pytest

from pdserve.cluster.api import openai_models as m
from pdserve.cluster.api.grpc_request import sampling_from_proto
from pdserve.cluster.api.openai_protocol import _sampling
from pdserve.cluster.clients.grpc_client import sampling_to_proto
from pdserve.engine.sampling import SamplingParams


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_grpc_round_trip(salt):
    assert sampling_from_proto(sampling_to_proto(SamplingParams(cache_salt=salt))).cache_salt == salt


def test_http_body_field():
    body = m.CompletionRequest.model_validate({"prompt": "hi", "cache_salt": "tenant-a"})
    assert _sampling(body, 16, None).cache_salt == "tenant-a"
    chat = m.ChatCompletionRequest.model_validate({"messages": [], "cache_salt": "tenant-b"})
    assert _sampling(chat, 16, None).cache_salt == "tenant-b"
    with pytest.raises(ValueError, match="cache_salt"):
        _sampling(m.CompletionRequest.model_validate({"prompt": "hi", "cache_salt": ""}), 16, None)
