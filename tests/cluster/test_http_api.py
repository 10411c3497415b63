"""The OpenAI-compatible HTTP API through the official `openai` client (and raw httpx for
what it cannot send), against a real server: Ray prefill and decode actors on the CPU, the
small model (its tokenizer and chat template are the default's), gRPC beside it.

Greedy text equal to the gRPC API's and the offline engine's, usage counts, n with seeds
giving each seed's answer, logprobs, OpenAI-shaped errors with the right status while the
server keeps serving, and a client that leaves mid-stream frees every block (by gRPC's
GetServerInfo and by /metrics).
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest

from pdserve.cluster.clients.grpc_client import Client
from pdserve.engine.sampling import SamplingParams
from tests.cluster.streams import collect, pools_are_full, scrape, wait_until

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def srv(disaggregated_server):
    return disaggregated_server


def grpc_text(srv, messages=None, prompt=None, max_tokens=12, params=None) -> tuple[str, int]:
    params = params or SamplingParams(temperature=0.0, max_tokens=max_tokens)
    if prompt is not None:
        got = collect(srv.target, prompt, params)
        return got.text, len(got.token_ids)
    with Client(srv.target) as c:
        resps = list(c.generate(None, params, messages, 120))
    return "".join(r.text for r in resps), sum(len(r.token_ids) for r in resps)


def engine_text(engine, params: SamplingParams, messages=None, prompt=None) -> str:
    """The offline engine's answer; chat messages go through its request processor's chat
    template, the one both frontends use."""
    return engine.generate([prompt if prompt is not None else engine.apply_chat_template(messages)], params)[0].text


def metrics_say_blocks_are_free(srv) -> bool:
    """/metrics: every worker's KV block use is 0 and it runs and queues nothing."""
    m = scrape(srv.config.server.metrics_port)
    usage = {k: v for k, v in m.items() if k.startswith("pdserve_kv_block_usage_ratio{")}
    busy = [v for k, v in m.items() if k.startswith(("pdserve_running_sequences{", "pdserve_waiting_sequences{"))]
    num_workers = sum(len(p.workers) for p in srv.server.worker_set.pools())
    return len(usage) == num_workers and not any(usage.values()) and not any(busy)


def test_models_and_health(srv, client, model):
    with Client(srv.target) as c:  # the served model's name, as gRPC's ListModels says
        assert c.list_models().models[0].id == model
    health = httpx.get(srv.http_url + "/health", timeout=10)
    assert health.status_code == 200 and health.json() == {"status": "ok"}


def test_completion_matches_grpc_and_the_engine_greedy_and_counts_usage(srv, client, model, tokenizer, engine):
    want, num_tokens = grpc_text(srv, prompt=PROMPT)
    assert want == engine_text(engine, SamplingParams(temperature=0.0, max_tokens=12), prompt=PROMPT)
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    assert out.object == "text_completion" and out.choices[0].text == want
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert out.usage.completion_tokens == num_tokens == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12

    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])

    stop = want[4:8]
    cut = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == want[:want.find(stop)] and cut.choices[0].finish_reason == "stop"


def test_chat_matches_grpc_and_the_engine_greedy(srv, client, model, tokenizer, engine):
    want, num_tokens = grpc_text(srv, messages=CHAT, max_tokens=10)
    assert want == engine_text(engine, SamplingParams(temperature=0.0, max_tokens=10), messages=CHAT)
    out = client.chat.completions.create(model=model, messages=CHAT, max_tokens=10, temperature=0)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == want
    template = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert out.usage.prompt_tokens == len(tokenizer.encode(template, add_special_tokens=False))
    assert out.usage.completion_tokens == num_tokens

    chunks = list(client.chat.completions.create(model=model, messages=CHAT, max_completion_tokens=10, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == out.choices[0].finish_reason
    # The template's own variables pass through (SmolLM2's ignores this one: the same answer),
    # and a model that does not think answers in content only.
    kept = client.chat.completions.create(model=model, messages=CHAT, max_tokens=10, temperature=0,
                                          extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert kept.choices[0].message.content == want
    assert kept.choices[0].message.model_extra.get("reasoning_content") is None


def seeded(seed: int, max_tokens: int, ignore_eos: bool = False) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, ignore_eos=ignore_eos)


def test_n_choices_with_a_seed_are_each_seeds_answer(srv, client, model):
    # Choice i draws from seed + i (cluster/api/openai_protocol.py): the answer gRPC gives that seed.
    def sample() -> list[str]:
        out = client.completions.create(model=model, prompt="Once upon a time", n=2, seed=1234, temperature=1.0,
                                        max_tokens=8, extra_body={"ignore_eos": True})
        assert sorted(c.index for c in out.choices) == [0, 1]
        assert out.usage.completion_tokens == 16
        return [c.text for c in sorted(out.choices, key=lambda c: c.index)]

    first = sample()
    assert first == sample() and first[0] != first[1]
    assert first == [grpc_text(srv, prompt="Once upon a time", params=seeded(1234 + i, 8, ignore_eos=True))[0]
                     for i in range(2)]
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, n=2, seed=7, max_tokens=4,
                                                 stream=True, stream_options={"include_usage": True}))
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == 2
    assert 2 <= chunks[-1].usage.completion_tokens <= 8
    texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
             for i in range(2)]
    assert texts == [grpc_text(srv, messages=CHAT, params=seeded(7 + i, 4))[0] for i in range(2)]


def test_seeded_answers_match_the_offline_engine(client, model, engine):
    out = client.completions.create(model=model, prompt="Once upon a time", n=2, seed=1234, temperature=1.0,
                                    max_tokens=8, extra_body={"ignore_eos": True})
    got = [c.text for c in sorted(out.choices, key=lambda c: c.index)]
    assert got == [engine_text(engine, seeded(1234 + i, 8, ignore_eos=True), prompt="Once upon a time")
                   for i in range(2)]


def test_logprobs(client, model):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 4 and "".join(lp.tokens) == out.choices[0].text
    assert all(len(top) == 2 and max(top.values()) >= v - 1e-5 for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    assert "".join(t.token for t in content) == chat.choices[0].message.content


def post(srv, path: str, content: bytes | str, content_type: str = "application/json") -> httpx.Response:
    return httpx.post(srv.http_url + path, content=content, headers={"Content-Type": content_type}, timeout=60)


@pytest.mark.parametrize("path, body, content_type, status, param, words", [
    ("/v1/completions", '{"model": "gpt-17", "prompt": "hi"}', "application/json", 404, "model", "gpt-17"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": -3}', "application/json", 400, "max_tokens", ">= 1"),
    ("/v1/completions", '{"prompt": "hi", "temperature": NaN}', "application/json", 400, "temperature", "finite"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "temperature": -1}',
     "application/json", 400, "temperature", ">= 0"),
    ("/v1/completions", '{"prompt": [1, 2, 3], "top_p": 0}', "application/json", 400, "top_p", "(0, 1]"),
    ("/v1/completions", '{"prompt": ' + str([5] * 9000) + '}', "application/json", 400, "prompt", "9000 tokens"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 4', "application/json", 400, None, "JSON"),
    ("/v1/completions", '{"max_tokens": 4}', "application/json", 400, "prompt", "required"),
    ("/v1/completions", '{"prompt": "hi"}', "text/plain", 415, None, "application/json"),
    ("/v1/chat/completions", '{"messages": [{"role": "wizard", "content": "x"}]}', "application/json", 400,
     "messages", "unknown roles"),
    ("/v1/chat/completions", '{"messages": [], "max_completion_tokens": 0}', "application/json", 400,
     "max_completion_tokens", ">= 1"),
    ("/v1/completions", '{"prompt": "hi", "presence_penalty": 2.5}', "application/json", 400, "presence_penalty",
     "[-2, 2]"),
    ("/v1/completions", '{"prompt": "hi", "frequency_penalty": -3}', "application/json", 400, "frequency_penalty",
     "[-2, 2]"),
    ("/v1/completions", '{"prompt": "hi", "repetition_penalty": 0}', "application/json", 400,
     "repetition_penalty", "> 0"),
    ("/v1/completions", '{"prompt": "hi", "logit_bias": {"99999999": 5}}', "application/json", 400, "logit_bias",
     "outside the vocabulary"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"11": 101}}',
     "application/json", 400, "logit_bias", "[-100, 100]"),
    ("/v1/completions", '{"prompt": "hi", "logit_bias": {"eleven": 1}}', "application/json", 400, "logit_bias",
     "numbers"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1}',
     "application/json", 400, "prompt_logprobs", "not supported"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "min_tokens": 5, "max_tokens": 2}',
     "application/json", 400, "min_tokens", "max_tokens=2"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}]}',
     "application/json", 400, "functions", "not supported"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": '
     '{"tokenize": true}}', "application/json", 400, "chat_template_kwargs", "may not set"),
    ("/v1/completions", '{"prompt": "hi", "priority": "1"}', "application/json", 400, "priority",
     "valid integer"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "priority": 1.5}',
     "application/json", 400, "priority", "valid integer"),
    ("/v1/embeddings", '{"input": "hi"}', "application/json", 404, None, "Not Found"),
])
def test_bad_requests_get_an_openai_error_and_the_server_keeps_serving(srv, client, model, path, body,
                                                                        content_type, status, param, words):
    resp = post(srv, path, body, content_type)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    assert words in error["message"], error
    assert client.completions.create(model=model, prompt="Hi", max_tokens=2, temperature=0).choices[0].text


def test_penalties_bias_and_min_tokens_reach_the_workers_over_http_and_grpc(srv, client, model, engine):
    """The same penalized greedy tokens as the offline engine, through the prefill worker (the
    first token, under min_tokens) and the decode worker (the rest, counting that first token).
    Two tokens biased far above the model's own take turns under the penalties; EOS, biased
    just below them, comes once the penalties have brought them under it, after min_tokens."""
    eos = engine.arch.eos_token_ids[0]
    bias = {11: 100.0, 12: 100.0, eos: 80.0}
    params = SamplingParams(temperature=0.0, max_tokens=10, frequency_penalty=2.0, presence_penalty=2.0,
                            repetition_penalty=1.5, logit_bias=bias, min_tokens=3)
    want = engine.generate([PROMPT], params)[0]
    assert sorted(want.token_ids[:2]) == [11, 12] and want.token_ids[2] in (11, 12) and want.token_ids[3:] == [eos]
    assert collect(srv.target, PROMPT, params).token_ids == want.token_ids
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0, frequency_penalty=2.0,
                                    presence_penalty=2.0, logit_bias={str(k): v for k, v in bias.items()},
                                    extra_body={"repetition_penalty": 1.5, "min_tokens": 3})
    assert out.choices[0].text == want.text and out.usage.completion_tokens == len(want.token_ids)
    assert out.choices[0].finish_reason == "stop"


def test_priority_is_accepted_and_changes_no_token(srv, client, model):
    """vLLM's priority field over HTTP, and GenerateRequest.priority over gRPC: who goes first,
    never what is generated."""
    want = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text
    for priority in (-5, 7):
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                                        extra_body={"priority": priority})
        assert out.choices[0].text == want
    assert collect(srv.target, PROMPT, SamplingParams(temperature=0.0, max_tokens=6, priority=3)).text == want


def test_unknown_model_through_the_client_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-17", messages=CHAT, max_tokens=2)
    assert err.value.body["code"] == "model_not_found"


def test_full_server_answers_429(srv, client, model, monkeypatch):
    coordinator = srv.server.frontend.coordinator
    monkeypatch.setattr(coordinator, "capacity", lambda: 1)  # one seat, no queue
    stream = client.completions.create(model=model, prompt="Tell me a long story.", max_tokens=500, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))  # it holds the only seat
    with pytest.raises(openai.RateLimitError) as err:
        client.completions.create(model=model, prompt="One more", max_tokens=2)
    assert "capacity of 1 concurrent requests" in err.value.body["message"]
    assert int(err.value.response.headers["Retry-After"]) >= 1
    stream.close()
    monkeypatch.undo()
    wait_until(lambda: pools_are_full(srv.target), 30, "blocks to be freed")


@pytest.mark.parametrize("chat", [False, True])
def test_client_leaving_mid_stream_frees_every_block(srv, client, model, chat):
    if chat:
        stream = client.chat.completions.create(model=model, messages=CHAT, max_tokens=2000, stream=True,
                                                extra_body={"ignore_eos": True})
    else:
        stream = client.completions.create(model=model, prompt="Tell me a very long story.", max_tokens=2000,
                                           stream=True, extra_body={"ignore_eos": True})
    for _, _ in zip(range(3), stream):
        pass
    stream.close()
    wait_until(lambda: pools_are_full(srv.target), 30, "blocks to be freed after the client left")
    wait_until(lambda: metrics_say_blocks_are_free(srv), 30, "/metrics to show every block free")
    assert client.completions.create(model=model, prompt="Hi", max_tokens=2).usage.completion_tokens >= 1


def test_client_leaving_before_a_whole_response_frees_every_block(srv):
    body = '{"prompt": "Tell me a very long story.", "max_tokens": 2000, "ignore_eos": true}'
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.http_url + "/v1/completions", content=body, headers={"Content-Type": "application/json"},
                   timeout=3)
    wait_until(lambda: pools_are_full(srv.target), 30, "blocks to be freed after the client left")
    wait_until(lambda: metrics_say_blocks_are_free(srv), 30, "/metrics to show every block free")


def test_generate_cli_speaks_the_http_api(srv):
    want, _ = grpc_text(srv, prompt=PROMPT, max_tokens=8)
    proc = subprocess.run([sys.executable, "-m", "pdserve.cluster.cli", "generate", "--target", srv.http_url,
                           "--temperature", "0", "--max-tokens", "8", PROMPT],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == want + "\n"
    bad = subprocess.run([sys.executable, "-m", "pdserve.cluster.cli", "generate", "--target", srv.http_url, ""],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "HTTP 400: prompt is empty" in bad.stderr and "Traceback" not in bad.stderr
