"""pdserve over real Ray actors, real UCX (TCP/shm) and real gRPC, on the CPU.

Token parity with the single-process engine, in disaggregated and colocated
modes; cancel and deadline free every block; bad input gets a precise status while the
server keeps serving; admission queues and refuses; a first token's hops add up to its
time. Lost workers are tests/cluster/test_failover.py's (apart, so that CI's two workers
run the two halves at once).
"""

from __future__ import annotations

import threading

import grpc
import pytest

from pdserve.cluster.clients.grpc_client import Client
from pdserve.engine.sampling import SamplingParams
from pdserve.proto.v1 import generation_pb2 as pb
from tests.cluster.streams import collect, collect_concurrently, pools_are_full, wait_until
from tests.engine.prompts import prompt_ids

pytestmark = pytest.mark.slow

PROMPT_LENGTHS = [5, 9, 17, 24, 33, 48, 64, 80, 96, 128, 150, 200, 256, 300, 350, 400]


@pytest.fixture(scope="module")
def workload(tokenizer) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = [prompt_ids(tokenizer, n, variant=i) for i, n in enumerate(PROMPT_LENGTHS)]
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    return prompts, params


@pytest.fixture(scope="module")
def expected(engine, workload) -> list[list[int]]:
    prompts, params = workload
    return [o.token_ids for o in engine.generate(prompts, params)]


@pytest.fixture(scope="module")
def disaggregated(disaggregated_server):
    return disaggregated_server


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_streamed_greedy_output_matches_the_engine(mode, colocated_server, disaggregated, workload, expected):
    srv = disaggregated if mode == "disaggregated" else colocated_server
    prompts, params = workload
    got = collect_concurrently(srv.target, prompts, params)
    for i, (g, want) in enumerate(zip(got, expected)):
        assert g.token_ids == want, f"{mode}: request {i} ({PROMPT_LENGTHS[i]} prompt tokens) differs"
        # One response per step, or fewer where the reader fell behind (deltas merged per chunk).
        assert g.finish_reason == pb.FINISH_REASON_LENGTH and 1 < g.num_responses <= len(want)
    wait_until(lambda: pools_are_full(srv.target), 10, "every block to be free")


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_a_repeated_prompt_reports_the_tokens_its_prefill_took_from_cache(mode, colocated_server, disaggregated,
                                                                          engine, tokenizer):
    """usage.cached_prompt_tokens is what the request's prefill found in its prefix cache, as
    the in-process engine counts it for the same prompt sent twice: in disaggregated mode the
    prefill worker's count (the decode worker counts the KV it was sent as computed)."""
    srv = disaggregated if mode == "disaggregated" else colocated_server
    prompt = tokenizer.encode(f"A prompt of the {mode} cache test:") + prompt_ids(tokenizer, 100, variant=5)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    want = [engine.generate([prompt], params)[0].num_cached_tokens for _ in range(2)]
    assert want[0] == 0 and want[1] >= 96, want  # the engine's own count: every full block but the last token's
    got = [collect(srv.target, prompt, params).num_cached_tokens for _ in range(2)]
    assert got == want, f"{mode}: cached prompt tokens {got}, the engine counts {want}"


def test_text_and_stop_strings_match_the_engine(disaggregated, engine):
    params = SamplingParams(temperature=0.0, max_tokens=40)
    want = engine.generate(["The three most important inventions in history are"], params)[0]
    got = collect(disaggregated.target, "The three most important inventions in history are", params)
    assert got.text == want.text
    stop = want.text[10:14]
    cut = collect(disaggregated.target, "The three most important inventions in history are",
                  SamplingParams(temperature=0.0, max_tokens=40, stop=(stop,)))
    assert cut.text == want.text[:want.text.find(stop)] and cut.finish_reason == pb.FINISH_REASON_STOP
    wait_until(lambda: pools_are_full(disaggregated.target), 10, "every block to be free after a stop string")


def test_request_ended_by_its_first_token_frees_the_decode_reservation(disaggregated, engine):
    params = SamplingParams(temperature=0.0, max_tokens=1)
    want = engine.generate(["The capital of France is"], params)[0].token_ids
    got = collect(disaggregated.target, "The capital of France is", params)
    assert got.token_ids == want and got.finish_reason == pb.FINISH_REASON_LENGTH
    wait_until(lambda: pools_are_full(disaggregated.target), 10, "the decode reservation to be freed")


def test_client_cancel_frees_blocks_everywhere(disaggregated):
    with Client(disaggregated.target) as client:
        call = client.generate("Tell me a very long story.", SamplingParams(max_tokens=2000, ignore_eos=True))
        for _, _ in zip(range(3), call):
            pass
        call.cancel()
    wait_until(lambda: pools_are_full(disaggregated.target), 10, "blocks to be freed after cancel")


def test_deadline_expiry_frees_blocks_everywhere(disaggregated):
    with Client(disaggregated.target) as client:
        with pytest.raises(grpc.RpcError) as err:
            for _ in client.generate("Tell me a very long story.", SamplingParams(max_tokens=2000, ignore_eos=True),
                                     timeout_s=1.5):
                pass
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: pools_are_full(disaggregated.target), 10, "blocks to be freed after the deadline")


@pytest.mark.parametrize("sampling, field", [
    (pb.SamplingParams(temperature=-1), "sampling.temperature"),
    (pb.SamplingParams(top_p=0), "sampling.top_p"),
    (pb.SamplingParams(top_p=1.5), "sampling.top_p"),
    (pb.SamplingParams(top_k=-2), "sampling.top_k"),
    (pb.SamplingParams(max_tokens=0), "sampling.max_tokens"),
    (pb.SamplingParams(max_tokens=-5), "sampling.max_tokens"),
    (pb.SamplingParams(min_p=3), "sampling.min_p"),
    (pb.SamplingParams(logprobs=99), "sampling.logprobs"),
    (pb.SamplingParams(stop_token_ids=[10**9]), "sampling.stop_token_ids"),
    (pb.SamplingParams(stop=[""]), "sampling.stop"),
])
def test_bad_sampling_fields_are_invalid_argument(disaggregated, sampling, field):
    req = pb.GenerateRequest(prompt="hello", sampling=sampling)
    assert_invalid(disaggregated.target, req, field.split(".")[1])


@pytest.mark.parametrize("make, words", [
    (lambda: pb.GenerateRequest(), "one of prompt, prompt_token_ids or messages"),
    (lambda: pb.GenerateRequest(prompt=""), "prompt is empty"),
    (lambda: pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1, -3])), "prompt_token_ids"),
    (lambda: pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1] * 9000)), "prompt_token_ids has 9000 tokens"),
    (lambda: pb.GenerateRequest(prompt="hi", model="gpt-17"), "model 'gpt-17' is not served"),
    (lambda: pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(presence_penalty=2.5)),
     "sampling.presence_penalty must be in [-2, 2]"),
    (lambda: pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(repetition_penalty=-1)),
     "sampling.repetition_penalty must be > 0"),
    (lambda: pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(logit_bias={99999999: 1.0})),
     "sampling.logit_bias: token ids [99999999] outside the vocabulary"),
    (lambda: pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=2, min_tokens=3)),
     "sampling.min_tokens must be <= max_tokens=2"),
    (lambda: pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="wizard", content="x")])),
     "unknown roles"),
])
def test_bad_requests_are_invalid_argument(disaggregated, make, words):
    assert_invalid(disaggregated.target, make(), words)


def assert_invalid(target: str, req: pb.GenerateRequest, words: str) -> None:
    with Client(target) as client:
        with pytest.raises(grpc.RpcError) as err:
            list(client.stub.Generate(req, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in err.value.details(), err.value.details()
    # ...and the server keeps serving.
    assert collect(target, "Hi", SamplingParams(temperature=0.0, max_tokens=2)).token_ids


def test_admission_queues_for_seats_and_kv_and_refuses_beyond_the_queue_at_once(start, tokenizer):
    """One decode worker of 40 KV blocks with 2 running seats and a queue of 1. The first
    request's prompt takes 25 blocks: the second, whose prompt needs 19, waits in the queue
    although a seat is free (not refused, not run); the third would wait behind a full queue
    and is refused with RESOURCE_EXHAUSTED and a retry hint, without waiting for any work:
    while both admitted requests still run or wait, and without joining the queue. Once the
    first ends, the queued one runs, and every block on both sides comes back."""

    srv = start(pools={"mode": "disaggregated"}, engine={"scheduler": {"max_num_seqs": 2}, "cache": {"num_blocks": 40}},
                admission={"max_waiting_per_worker": 1, "retry_after_s": 2.5})
    worker_set = srv.server.worker_set
    decode = worker_set.decode.workers[0]
    assert worker_set.seats.capacity() == 3 and worker_set.seats.max_queued() == 1
    queued: list = []
    with Client(srv.target) as holder, Client(srv.target) as other:
        running = holder.generate(prompt_ids(tokenizer, 400, variant=29),
                                  SamplingParams(max_tokens=10**6, ignore_eos=True), timeout_s=120)
        next(running)  # it holds a seat and 25 of the 40 blocks, and grows into the rest
        waiter = threading.Thread(target=lambda: queued.append(
            collect(srv.target, prompt_ids(tokenizer, 300, variant=31),
                    SamplingParams(temperature=0.0, max_tokens=4), 120)))
        waiter.start()
        wait_until(lambda: worker_set.seats.num_queued == 1 and _num_admitted(srv) == 2, 30,
                   "the second request to be admitted and queued for KV blocks")
        assert decode.state.inflight == 1 < worker_set.seats.seats_per_worker  # a seat is free: it waits for KV
        with pytest.raises(grpc.RpcError) as err:
            list(other.generate("A third", SamplingParams(max_tokens=4), timeout_s=30))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "1 requests are queued" in err.value.details() and "retry in 2.5 s" in err.value.details()
        assert ("grpc-retry-pushback-ms", "2500") in tuple(err.value.trailing_metadata())
        # Refused without waiting for work: the first still streams, the second still waits,
        # and the third left nothing behind (the queue holds the second alone).
        assert not next(running).finish_reason
        assert waiter.is_alive() and not queued and worker_set.seats.num_queued == 1 and _num_admitted(srv) == 2
        running.cancel()
        waiter.join(120)
    assert len(queued) == 1 and len(queued[0].token_ids) == 4
    wait_until(lambda: pools_are_full(srv.target), 30, "blocks to be freed on both workers")
    assert not decode.state.claims and decode.state.inflight == 0


def _num_admitted(srv) -> int:
    """Requests the gRPC service holds (running and queued)."""
    return srv.server.frontend.inflight


def _histogram(srv, name: str) -> dict[tuple[str, str], float]:
    """(sample name, hop label) -> value of one of the server's histograms."""
    return {(s.name, s.labels.get("hop", "")): s.value for m in srv.server.metrics.registry.collect()
            if m.name == name for s in m.samples}


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_a_first_tokens_hops_are_its_path_and_add_up_to_its_ttft(mode, colocated_server, disaggregated, tokenizer):
    from pdserve.cluster.serving.coordinator import COLOCATED_HOPS, DISAGGREGATED_HOPS

    srv = disaggregated if mode == "disaggregated" else colocated_server
    hops_before = _histogram(srv, "pdserve_first_token_hop_seconds")
    ttft_before = _histogram(srv, "pdserve_time_to_first_token_seconds")
    out = collect(srv.target, prompt_ids(tokenizer, 40), SamplingParams(temperature=0.0, max_tokens=3))
    assert len(out.token_ids) == 3
    hops_after = _histogram(srv, "pdserve_first_token_hop_seconds")
    ttft_after = _histogram(srv, "pdserve_time_to_first_token_seconds")

    def delta(hop: str, sample: str) -> float:
        key = (f"pdserve_first_token_hop_seconds_{sample}", hop)
        return hops_after.get(key, 0.0) - hops_before.get(key, 0.0)

    path = (*DISAGGREGATED_HOPS, "other") if mode == "disaggregated" else (*COLOCATED_HOPS, "other")
    observed = {hop for (_, hop) in hops_after if delta(hop, "count") > 0}
    assert observed == set(path) | ({"reserve"} if mode == "disaggregated" else set())
    assert all(delta(hop, "count") == 1 for hop in observed)
    assert all(delta(hop, "sum") >= 0 for hop in observed)
    # The prefill worker computed the prompt, or the colocated engine did: not free.
    assert delta("prefill_compute" if mode == "disaggregated" else "first_delta", "sum") > 0
    ttft = (ttft_after[("pdserve_time_to_first_token_seconds_sum", "")]
            - ttft_before.get(("pdserve_time_to_first_token_seconds_sum", ""), 0.0))
    assert sum(delta(hop, "sum") for hop in path) == pytest.approx(ttft, rel=1e-6, abs=1e-9)


def test_the_context_ends_a_disaggregated_request_where_it_ends_a_colocated_one(start, tokenizer):
    """A context of 64 tokens: a prompt of 63 gets exactly one token (the prefill worker's,
    which ends it: no decode worker computes a position past the context), one of 62 gets
    two, however large max_tokens is; the same in both modes, every block free after."""
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for mode in ("disaggregated", "colocated"):
        srv = start(pools={"mode": mode}, engine={"model": {"max_model_len": 64}})
        for prompt_len, want in ((63, 1), (62, 2)):
            got = collect(srv.target, prompt_ids(tokenizer, prompt_len, variant=prompt_len), params)
            assert len(got.token_ids) == want and got.finish_reason == pb.FINISH_REASON_LENGTH, (mode, prompt_len, got)
        wait_until(lambda: pools_are_full(srv.target), 10, f"every block to be free ({mode})")
