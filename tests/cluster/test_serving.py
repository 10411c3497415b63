"""pdserve over real Ray actors, real UCX (TCP/shm) and real gRPC, on the CPU.

Token parity with the single-process engine, in disaggregated and colocated
modes; cancel, deadline and lost workers free every block; a stream whose decode worker
dies continues on another; bad input gets a precise status while the server keeps serving.
"""

from __future__ import annotations

import os
import signal
import threading

import grpc
import pytest

from pdserve.cluster.client import Client
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
        assert g.finish_reason == pb.FINISH_REASON_LENGTH and g.num_responses == len(want)
    wait_until(lambda: pools_are_full(srv.target), 10, "every block to be free")


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


def test_a_stream_whose_decode_worker_is_sigkilled_continues_on_its_replacement(disaggregated, engine, tokenizer):
    """The decode worker's process is SIGKILLed mid-stream: the request continues (prompt
    plus the tokens streamed so far prefilled again) on the lost worker's replacement, the
    only decode worker there is; the client's stream has exactly the undisturbed run's tokens.
    The prefill worker still caches the prompt's full blocks: the re-prefill finds them
    (they are sent again, not recomputed)."""
    import ray

    coordinator = disaggregated.server.coordinator
    prompt, params = prompt_ids(tokenizer, 100, variant=19), SamplingParams(temperature=0.0, max_tokens=200,
                                                                            ignore_eos=True)
    want = engine.generate([prompt], params)[0].token_ids
    victim, prefill = coordinator.decode.workers[0], coordinator.prefill.workers[0]
    pid = ray.get(victim.actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
    before = _migrations(disaggregated)
    got: list[int] = []
    with Client(disaggregated.target) as client:
        for resp in client.generate(prompt, params, timeout_s=300):
            got.extend(resp.token_ids)
            if len(got) >= 4 and victim.state.healthy and pid:
                hits = _prefix_hit_tokens(prefill)  # the first prefill is done
                os.kill(pid, signal.SIGKILL)
                pid = 0
            finish = resp.finish_reason
    assert got == want and finish == pb.FINISH_REASON_LENGTH
    assert _migrations(disaggregated) == before + 1
    assert coordinator.decode.workers[0] is not victim and coordinator.decode.workers[0].state.healthy
    assert _prefix_hit_tokens(prefill) - hits == 16 * (len(prompt) // 16)  # every full block of the prompt
    wait_until(lambda: pools_are_full(disaggregated.target), 30, "every block to be free")


def _prefix_hit_tokens(worker) -> int:
    """Prompt tokens `worker`'s engine has found in its prefix cache so far."""
    import ray

    return ray.get(worker.actor.load.remote(), timeout=60).prefix_hit_tokens


def test_a_decode_worker_killed_while_kv_is_sent_to_it_is_fenced_and_the_request_migrates(
        disaggregated, engine, tokenizer):
    """The decode worker has reserved a long prompt's blocks and the prefill worker, which
    computes it, has addressed its KV to that worker's incarnation, when the decode
    worker's process is SIGKILLed. The transfer to the dead incarnation fails and is not
    reported; the request migrates to the replacement (a new incarnation) and streams the
    undisturbed run's tokens, its re-prefill served from the prefill worker's prefix cache.
    The prefill worker is not wedged (not replaced, the next request runs) and every block
    on every worker is free afterwards."""
    import ray

    coordinator = disaggregated.server.coordinator
    prompt = prompt_ids(tokenizer, 1500, variant=23)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = engine.generate([prompt], params)[0].token_ids
    victim, prefill = coordinator.decode.workers[0], coordinator.prefill.workers[0]
    pid = ray.get(victim.actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
    before, hits = _migrations(disaggregated), _prefix_hit_tokens(prefill)
    responses: list = []

    def run() -> None:
        with Client(disaggregated.target) as client:
            responses.extend(client.generate(prompt, params, timeout_s=600))

    waiter = threading.Thread(target=run)
    waiter.start()
    wait_until(lambda: prefill.state.inflight == 1
               and ray.get(victim.actor.load.remote(), timeout=30).num_receiving == 1, 60,
               "the decode worker to expect the KV that the prefill worker computes")
    os.kill(pid, signal.SIGKILL)
    waiter.join(600)
    assert not waiter.is_alive(), "the request hung"
    assert [t for r in responses for t in r.token_ids] == want
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert len(responses[-1].kv_transfers) == 1  # to the replacement only
    fresh = coordinator.decode.workers[0]
    assert fresh is not victim and fresh.state.healthy
    assert fresh.address.incarnation and fresh.address.incarnation != victim.address.incarnation
    assert _migrations(disaggregated) == before + 1
    assert _prefix_hit_tokens(prefill) - hits >= 16 * ((len(prompt) - 1) // 16)
    assert coordinator.prefill.workers[0] is prefill and prefill.state.healthy and prefill.state.inflight == 0
    short = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    assert collect(disaggregated.target, "Name three colours.", short).token_ids == \
        engine.generate(["Name three colours."], short)[0].token_ids
    wait_until(lambda: pools_are_full(disaggregated.target), 30, "every block to be free")


def test_a_new_request_waits_for_the_only_decode_workers_replacement(disaggregated, engine):
    """The only decode worker is SIGKILLed and found lost: a request that arrives while its
    replacement starts waits for it (it is not refused UNAVAILABLE) and gets the engine's tokens."""
    import ray

    coordinator = disaggregated.server.coordinator
    prompt, params = "Name three colours.", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = engine.generate([prompt], params)[0].token_ids
    victim = coordinator.decode.workers[0]
    os.kill(ray.get(victim.actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30), signal.SIGKILL)
    wait_until(lambda: coordinator.decode.replacing == 1, 30, "the pool to begin replacing its lost worker")
    got = collect(disaggregated.target, prompt, params, 300)
    assert got.token_ids == want
    assert coordinator.decode.workers[0] is not victim and coordinator.decode.replacing == 0
    wait_until(lambda: pools_are_full(disaggregated.target), 30, "every block to be free")


def test_a_request_whose_prefill_worker_is_sigkilled_mid_prefill_is_retried(disaggregated, engine, tokenizer):
    """The prefill worker dies while it computes the prompt: the request is prefilled again
    on the replacement and the client's stream is the undisturbed run's."""
    import ray

    coordinator = disaggregated.server.coordinator
    prompt = prompt_ids(tokenizer, 1500, variant=7)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    want = engine.generate([prompt], params)[0].token_ids
    victim = coordinator.prefill.workers[0]
    pid = ray.get(victim.actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
    before = _migrations(disaggregated)
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(collect(disaggregated.target, prompt, params, 300)))
    waiter.start()
    wait_until(lambda: victim.state.inflight == 1, 30, "the prefill to start")
    os.kill(pid, signal.SIGKILL)
    waiter.join(300)
    assert got and got[0].token_ids == want
    assert _migrations(disaggregated) == before + 1
    assert coordinator.prefill.workers[0] is not victim
    wait_until(lambda: pools_are_full(disaggregated.target), 30, "every block to be free")


def test_a_colocated_stream_whose_worker_is_sigkilled_continues(colocated_server, engine):
    import ray

    srv = colocated_server
    coordinator = srv.server.coordinator
    prompt, params = "Tell me a very long story.", SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    want = engine.generate([prompt], params)[0].token_ids
    victim = coordinator.decode.workers[0]
    pid = ray.get(victim.actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
    before = _migrations(srv)
    got: list[int] = []
    with Client(srv.target) as client:
        for resp in client.generate(prompt, params, timeout_s=300):
            got.extend(resp.token_ids)
            if len(got) >= 4 and pid:
                os.kill(pid, signal.SIGKILL)
                pid = 0
    assert got == want and _migrations(srv) == before + 1
    wait_until(lambda: pools_are_full(srv.target), 30, "every block to be free")


def _migrations(srv) -> float:
    return sum(s.value for m in srv.server.metrics.migrations.collect() for s in m.samples
               if s.name.endswith("_total"))


def test_admission_queues_for_seats_and_kv_and_refuses_beyond_the_queue_at_once(start, tokenizer):
    """One decode worker of 40 KV blocks with 2 running seats and a queue of 1. The first
    request's prompt takes 25 blocks: the second, whose prompt needs 19, waits in the queue
    although a seat is free (not refused, not run); the third would wait behind a full queue
    and is refused with RESOURCE_EXHAUSTED and a retry hint, without waiting for any work:
    while both admitted requests still run or wait, and without joining the queue. Once the
    first ends, the queued one runs, and every block on both sides comes back."""

    srv = start(pools={"mode": "disaggregated"}, engine={"scheduler": {"max_num_seqs": 2}, "cache": {"num_blocks": 40}},
                admission={"max_waiting_per_worker": 1, "retry_after_s": 2.5})
    coordinator = srv.server.coordinator
    decode = coordinator.decode.workers[0]
    assert coordinator.capacity() == 3 and coordinator.max_queued() == 1
    queued: list = []
    with Client(srv.target) as holder, Client(srv.target) as other:
        running = holder.generate(prompt_ids(tokenizer, 400, variant=29),
                                  SamplingParams(max_tokens=10**6, ignore_eos=True), timeout_s=120)
        next(running)  # it holds a seat and 25 of the 40 blocks, and grows into the rest
        waiter = threading.Thread(target=lambda: queued.append(
            collect(srv.target, prompt_ids(tokenizer, 300, variant=31),
                    SamplingParams(temperature=0.0, max_tokens=4), 120)))
        waiter.start()
        wait_until(lambda: coordinator.num_queued == 1 and _num_admitted(srv) == 2, 30,
                   "the second request to be admitted and queued for KV blocks")
        assert decode.state.inflight == 1 < coordinator.seats_per_worker  # a seat is free: it waits for KV
        with pytest.raises(grpc.RpcError) as err:
            list(other.generate("A third", SamplingParams(max_tokens=4), timeout_s=30))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "1 requests are queued" in err.value.details() and "retry in 2.5 s" in err.value.details()
        assert ("grpc-retry-pushback-ms", "2500") in tuple(err.value.trailing_metadata())
        # Refused without waiting for work: the first still streams, the second still waits,
        # and the third left nothing behind (the queue holds the second alone).
        assert not next(running).finish_reason
        assert waiter.is_alive() and not queued and coordinator.num_queued == 1 and _num_admitted(srv) == 2
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
    from pdserve.cluster.coordinator import COLOCATED_HOPS, DISAGGREGATED_HOPS

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
