"""Prompt log-probabilities through the servers (issue 38): `echo` with `logprobs` (and
`max_tokens: 0`, how lm-eval asks for log-likelihoods) and vLLM's `prompt_logprobs` on
/v1/completions through the official `openai` client, the same through gRPC, held to the
small model's Hugging Face forward; bad values are a 400 / INVALID_ARGUMENT naming the field.
On the shared disaggregated server, so the prefill worker computes them; the colocated one
once, where the mixed worker does."""

from __future__ import annotations

import grpc
import httpx
import openai
import pytest
import torch

from pdserve.cluster.clients.grpc_client import Client
from pdserve.proto.v1 import generation_pb2 as pb

pytestmark = pytest.mark.slow

TOLERANCE = 1e-4
PROMPT = "The quick brown fox jumps over the lazy dog near the river bank"


@pytest.fixture(scope="module")
def srv(disaggregated_server):
    return disaggregated_server


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[int]:
    return tokenizer.encode(PROMPT)


def hf_logprobs(small_model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row p is the small model's log-distribution after position p."""
    with torch.no_grad():
        return torch.log_softmax(small_model.hf(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.fixture(scope="module")
def reference(small_model, prompt_ids) -> torch.Tensor:
    return hf_logprobs(small_model, prompt_ids)


def check_echoed(choice, prompt_ids: list[int], reference: torch.Tensor, num_top: int, tokenizer) -> None:
    """choice.logprobs begin with the prompt's tokens: the first null, then the model's."""
    lp, n = choice.logprobs, len(prompt_ids)
    assert lp.tokens[:n] == [tokenizer.decode([t]) for t in prompt_ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, n):
        assert abs(lp.token_logprobs[i] - reference[i - 1, prompt_ids[i]].item()) < TOLERANCE, i
        want = reference[i - 1].topk(num_top)
        assert len(lp.top_logprobs[i]) == num_top
        assert sorted(lp.top_logprobs[i].values(), reverse=True) == pytest.approx(want.values.tolist(), abs=TOLERANCE)
    # Each token's offset is where its text stands in the echoed text.
    assert len(lp.text_offset) == len(lp.tokens) and lp.text_offset[0] == 0
    for token, offset in zip(lp.tokens, lp.text_offset):
        assert choice.text[offset:offset + len(token)] == token


def test_echo_with_max_tokens_0_is_the_prompt_and_its_logprobs(client, model, prompt_ids, reference, tokenizer):
    out = client.completions.create(model=model, prompt=PROMPT, echo=True, logprobs=2, max_tokens=0, temperature=0)
    choice = out.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(prompt_ids)
    check_echoed(choice, prompt_ids, reference, 2, tokenizer)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt_ids), 0)


def test_echo_puts_the_prompt_before_the_completion(client, model, prompt_ids, reference, tokenizer):
    plain = client.completions.create(model=model, prompt=prompt_ids, max_tokens=3, temperature=0, logprobs=1)
    out = client.completions.create(model=model, prompt=prompt_ids, echo=True, logprobs=1, max_tokens=3,
                                    temperature=0)
    choice, n = out.choices[0], len(prompt_ids)
    assert choice.text == PROMPT + plain.choices[0].text
    assert choice.logprobs.tokens[n:] == plain.choices[0].logprobs.tokens
    assert choice.logprobs.token_logprobs[n:] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-6)
    check_echoed(choice, prompt_ids, reference, 1, tokenizer)
    # Echo without logprobs: the text alone.
    bare = client.completions.create(model=model, prompt=PROMPT, echo=True, max_tokens=3, temperature=0)
    assert bare.choices[0].text == choice.text and bare.choices[0].logprobs is None


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_a_streamed_echo_assembles_to_the_whole_response(client, model, max_tokens):
    """The first chunk starts with the prompt and its tokens' logprobs; the chunks joined are
    the unstreamed choice: text, tokens, logprobs and each token's offset in the echoed text."""
    whole = client.completions.create(model=model, prompt=PROMPT, echo=True, logprobs=2, max_tokens=max_tokens,
                                      temperature=0).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(
        model=model, prompt=PROMPT, echo=True, logprobs=2, max_tokens=max_tokens, temperature=0, stream=True)
        if c.choices]
    assert chunks[0].text.startswith(PROMPT)
    assert "".join(c.text for c in chunks) == whole.text
    joined = {field: [x for c in chunks for x in getattr(c.logprobs, field)]
              for field in ("tokens", "token_logprobs", "text_offset", "top_logprobs")}
    assert joined["tokens"] == whole.logprobs.tokens and joined["text_offset"] == whole.logprobs.text_offset
    assert joined["token_logprobs"] == pytest.approx(whole.logprobs.token_logprobs, abs=1e-6)
    assert [t and sorted(t) for t in joined["top_logprobs"]] == [t and sorted(t) for t in whole.logprobs.top_logprobs]
    assert chunks[-1].finish_reason == whole.finish_reason == "length"


def test_vllm_prompt_logprobs(client, model, prompt_ids, small_model, tokenizer):
    """A list with null first, then {token id: {logprob, rank, decoded_token}} of the prompt's
    token and its top alternatives, computed afresh for a prompt the prefix cache holds."""
    for _ in range(2):
        out = client.completions.create(model=model, prompt=prompt_ids * 3, max_tokens=1, temperature=0,
                                        extra_body={"prompt_logprobs": 3})
        assert out.usage.prompt_tokens_details.cached_tokens == 0
    entries = out.choices[0].model_extra["prompt_logprobs"]
    streamed = client.completions.create(model=model, prompt=prompt_ids * 3, max_tokens=2, temperature=0,
                                         stream=True, extra_body={"prompt_logprobs": 3})
    firsts = [c.choices[0].model_extra.get("prompt_logprobs") for c in streamed if c.choices]
    assert firsts[0] == entries and not any(firsts[1:]), "the first chunk carries them, as vLLM streams them"
    ids = prompt_ids * 3
    ref = hf_logprobs(small_model, ids)
    assert len(entries) == len(ids) and entries[0] is None
    for i in range(1, len(ids)):
        entry = {int(k): v for k, v in entries[i].items()}
        mine = entry[ids[i]]
        want = ref[i - 1]
        assert abs(mine["logprob"] - want[ids[i]].item()) < TOLERANCE
        assert mine["decoded_token"] == tokenizer.decode([ids[i]])
        lo, hi = int((want > want[ids[i]] + TOLERANCE).sum()) + 1, int((want > want[ids[i]] - TOLERANCE).sum()) + 1
        assert lo <= mine["rank"] <= hi
        top = want.topk(3)
        for rank, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
            if t != ids[i] or mine["rank"] == rank:
                assert entry[t]["rank"] == rank and abs(entry[t]["logprob"] - v) < TOLERANCE


def test_grpc_prompt_logprobs_with_max_tokens_0(srv, prompt_ids, reference):
    request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt_ids),
                                 sampling=pb.SamplingParams(max_tokens=0, prompt_logprobs=2, temperature=0))
    with Client(srv.target) as c:
        responses = list(c.stub.Generate(request, timeout=120))
    assert [list(r.token_ids) for r in responses] == [[]] and responses[-1].text == ""
    last = responses[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH and last.usage.completion_tokens == 0
    entries = last.prompt_logprobs
    assert [e.token_id for e in entries] == prompt_ids[1:]
    for i, e in enumerate(entries, start=1):
        want = reference[i - 1]
        assert abs(e.logprob - want[prompt_ids[i]].item()) < TOLERANCE
        assert list(e.top_logprobs) == pytest.approx(want.topk(2).values.tolist(), abs=TOLERANCE)
        assert want[list(e.top_token_ids)].tolist() == pytest.approx(list(e.top_logprobs), abs=TOLERANCE)
        assert e.rank >= 1


def test_colocated_serving_computes_them_too(colocated_server, prompt_ids, reference):
    params = pb.SamplingParams(max_tokens=2, prompt_logprobs=0, temperature=0)
    with Client(colocated_server.target) as c:
        responses = list(c.stub.Generate(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt_ids),
                                                            sampling=params), timeout=120))
    assert sum(len(r.token_ids) for r in responses) == 2
    assert len(responses[0].prompt_logprobs) == len(prompt_ids) - 1
    assert all(not r.prompt_logprobs for r in responses[1:])
    got = torch.tensor([e.logprob for e in responses[0].prompt_logprobs])
    want = reference[:-1].gather(1, torch.tensor(prompt_ids[1:])[:, None])[:, 0]
    assert torch.allclose(got, want, atol=TOLERANCE)


@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs", "[0, 20]"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": -1}, "prompt_logprobs", "[0, 20]"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens", "only with echo"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo",
     "not supported"),
])
def test_bad_values_are_a_400_naming_the_field(srv, client, model, path, body, param, words):
    resp = httpx.post(srv.http_url + path, json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert client.completions.create(model=model, prompt="Hi", max_tokens=1, temperature=0).choices[0].text


@pytest.mark.parametrize("sampling, words", [
    (pb.SamplingParams(prompt_logprobs=21), "sampling.prompt_logprobs must be in [0, 20]"),
    (pb.SamplingParams(prompt_logprobs=-2), "sampling.prompt_logprobs must be in [0, 20]"),
    (pb.SamplingParams(max_tokens=0), "sampling.max_tokens must be >= 1 (0 only with prompt_logprobs)"),
])
def test_grpc_bad_values_are_invalid_argument(srv, sampling, words):
    with Client(srv.target) as c, pytest.raises(grpc.RpcError) as e:
        list(c.stub.Generate(pb.GenerateRequest(prompt="hi", sampling=sampling), timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details()


def test_the_openai_client_raises_bad_request(client, model):
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(model=model, prompt="hi", max_tokens=1, extra_body={"prompt_logprobs": 99})
