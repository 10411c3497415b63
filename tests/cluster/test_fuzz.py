"""Fuzzing the gRPC input (hypothesis): random field values in GenerateRequest, and bytes
that are no GenerateRequest at all, get OK or INVALID_ARGUMENT, never INTERNAL or
UNKNOWN; afterwards the server is SERVING and every KV block is free.

A request that passes validation is cancelled after its first response: that it started
is what the status says, and its blocks must come back all the same.
"""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.proto.v1 import generation_pb2 as pb
from tests.cluster.streams import pools_are_full, wait_until

pytestmark = pytest.mark.slow

EXAMPLES = 300  # each valid one runs a (short) prefill on the CPU
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}

int32 = st.integers(-(2**31), 2**31 - 1)
int64 = st.integers(-(2**63), 2**63 - 1)
float32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
text = st.text(max_size=40)
small_ints = st.one_of(st.integers(-3, 8), int32)
token_ids = st.lists(st.one_of(st.integers(0, 49151), int64), max_size=24)


@st.composite
def sampling(draw) -> pb.SamplingParams:
    msg = pb.SamplingParams(stop=draw(st.lists(text, max_size=3)), stop_token_ids=draw(st.lists(int64, max_size=3)),
                            ignore_eos=draw(st.booleans()))
    for name, values in (("temperature", float32), ("top_p", float32), ("min_p", float32), ("top_k", small_ints),
                         ("max_tokens", small_ints), ("seed", int64), ("logprobs", small_ints)):
        if draw(st.booleans()):
            setattr(msg, name, draw(values))
    return msg


@st.composite
def requests(draw) -> pb.GenerateRequest:
    req = pb.GenerateRequest(request_id=draw(text), model=draw(st.sampled_from(["", "nope"]) | text))
    which = draw(st.sampled_from(["prompt", "ids", "messages", "none"]))
    if which == "prompt":
        req.prompt = draw(text)
    elif which == "ids":
        req.prompt_token_ids.ids.extend(draw(token_ids))
    elif which == "messages":
        roles = st.sampled_from(["user", "system", "assistant", "wizard", ""]) | text
        for role, content in draw(st.lists(st.tuples(roles, text), max_size=3)):
            req.messages.messages.add(role=role, content=content)
    if draw(st.booleans()):
        req.sampling.CopyFrom(draw(sampling()))
    return req


@pytest.fixture(scope="module")
def srv(start):
    return start(pools={"mode": "disaggregated"})


@pytest.fixture(scope="module")
def channel(srv):
    with grpc.insecure_channel(srv.target) as ch:
        yield ch


def _status(call) -> grpc.StatusCode:
    try:
        next(call, None)
    except grpc.RpcError as e:
        return e.code()
    call.cancel()
    return grpc.StatusCode.OK


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(req=requests())
def test_random_requests_are_ok_or_invalid_argument(channel, req):
    generate = channel.unary_stream("/pdserve.v1.Generation/Generate",
                                    request_serializer=pb.GenerateRequest.SerializeToString,
                                    response_deserializer=pb.GenerateResponse.FromString)
    code = _status(generate(req, timeout=120))
    assert code in ALLOWED, (code, req)


@settings(max_examples=EXAMPLES // 2, deadline=None, suppress_health_check=list(HealthCheck))
@given(payload=st.binary(max_size=64))
def test_bytes_that_are_no_request_are_ok_or_invalid_argument(channel, payload):
    generate = channel.unary_stream("/pdserve.v1.Generation/Generate", request_serializer=lambda b: b,
                                    response_deserializer=pb.GenerateResponse.FromString)
    code = _status(generate(payload, timeout=120))
    assert code in ALLOWED, (code, payload)


def test_the_server_serves_on_with_every_block_free(srv, channel):
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    wait_until(lambda: pools_are_full(srv.target), 30, "every block to be free after the fuzzing")
