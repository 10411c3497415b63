"""The offline engine on the real default model: stopping, streaming, seeds, aborts."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from pdserve.engine.kv_handoff import NoCapacity
from pdserve.engine.messages import WorkerRequest
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.sequence import FinishReason
from tests.engine.prompts import prompt_ids

pytestmark = pytest.mark.slow

PROMPT = "The three most important inventions in history are"


def all_blocks_free(engine) -> bool:
    return engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_stop_string_cuts_the_text_before_it(engine):
    full = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=40))[0]
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 4]
    assert stop.strip(), f"pick a visible stop string from {full.text!r}"
    cut = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=40, stop=(stop,)))[0]
    assert cut.finish_reason is FinishReason.STOP
    assert cut.text == full.text[:full.text.find(stop)]
    assert cut.token_ids == full.token_ids[:len(cut.token_ids)]


def test_stop_token_ids_and_max_tokens(engine):
    full = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0]
    assert full.finish_reason is FinishReason.LENGTH and len(full.token_ids) == 20
    stop_id = full.token_ids[7]
    cut = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                                     stop_token_ids=(stop_id,)))[0]
    assert cut.finish_reason is FinishReason.STOP
    assert cut.token_ids == full.token_ids[:full.token_ids.index(stop_id) + 1]


def test_streamed_deltas_add_up_to_the_whole_output(engine):
    params = SamplingParams(temperature=0.0, max_tokens=24)
    whole = engine.generate([PROMPT, "Once upon a time"], params)
    texts, tokens = {}, {}
    for delta in engine.generate_stream([PROMPT, "Once upon a time"], params):
        texts[delta.request_id] = texts.get(delta.request_id, "") + delta.text
        tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
    assert sorted(texts.values()) == sorted(o.text for o in whole)
    assert sorted(tokens.values()) == sorted(o.token_ids for o in whole)
    assert all(t == engine.tokenizer.decode(o.token_ids, skip_special_tokens=True) for t, o in
               zip([o.text for o in whole], whole))


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(engine, tokenizer):
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=42, max_tokens=24)
    alone = engine.generate([PROMPT], seeded)[0].token_ids
    others = [prompt_ids(tokenizer, n, variant=n) for n in (30, 90, 200)]
    mixed = engine.generate(others + [PROMPT], [SamplingParams(temperature=1.0, max_tokens=30)] * 3 + [seeded])
    assert mixed[-1].token_ids == alone
    other_seed = engine.generate([PROMPT], SamplingParams(temperature=0.8, top_p=0.95, seed=43, max_tokens=24))
    assert other_seed[0].token_ids != alone


def test_a_seeded_request_draws_the_same_tokens_wherever_they_are_sampled(engine, make_engine, tokenizer):
    """The same tokens alone, in a batch, split as disaggregation splits it (a prefill engine
    samples token 0 and hands the KV to another engine, which decodes the rest), and continued
    as a migrated request is (a fresh engine prefills the prompt plus the tokens so far)."""
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=42, max_tokens=10, ignore_eos=True)
    alone = engine.generate([PROMPT], seeded)[0].token_ids
    others = [prompt_ids(tokenizer, n, variant=n) for n in (30, 90)]
    mixed = engine.generate(others + [PROMPT], [SamplingParams(temperature=1.0, max_tokens=12)] * 2 + [seeded])
    assert mixed[-1].token_ids == alone

    prefill = make_engine(seed=7)  # another shared generator: it must not matter
    rid = prefill.add_request(PROMPT, dataclasses.replace(seeded, max_tokens=1), hold_kv=True)
    (first,) = [d for _ in range(4) for d in prefill.step()]
    assert first.token_ids == (alone[0],)
    dst = engine.reserve(WorkerRequest("split", tuple(engine.tokenize(PROMPT)), seeded))
    engine.pool.kv[:, :, dst] = prefill.pool.kv[:, :, list(first.held_block_ids)]
    assert prefill.release(rid)
    engine.admit_prefilled("split", first.token_ids[0])
    split = [first.token_ids[0]]
    while engine.has_unfinished:
        split += [t for d in engine.step() if d.request_id == "split" for t in d.token_ids]
    assert split == alone

    for k in (1, 4):
        rest = dataclasses.replace(seeded, max_tokens=seeded.max_tokens - k)
        prefill.add_request(engine.tokenize(PROMPT) + alone[:k], rest, f"cont-{k}", num_prior_output_tokens=k)
        continued = [t for _ in range(40) for d in prefill.step() for t in d.token_ids]
        assert continued == alone[k:]
    with pytest.raises(ValueError, match="num_prior_output_tokens"):
        prefill.add_request([1, 2], seeded, num_prior_output_tokens=3)


def test_logprobs_match_hf(engine, hf_model):
    out = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=3, logprobs=2))[0]
    ids = torch.tensor([list(out.prompt_token_ids)])
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(ids).logits[0, -1].float(), dim=-1)
    first = out.logprobs[0]
    assert first.token_id == out.token_ids[0] == first.top_token_ids[0]
    assert first.logprob == pytest.approx(ref[first.token_id].item(), abs=1e-3)
    assert list(first.top_token_ids) == ref.topk(2).indices.tolist()


def test_abort_frees_blocks_and_others_continue(engine):
    keep = engine.add_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=8))
    drop = engine.add_request("Tell me a long story about dragons", SamplingParams(temperature=0.0, max_tokens=50))
    engine.step()
    assert engine.abort(drop)
    assert not engine.abort(drop)
    finished = []
    while engine.has_unfinished:
        finished += [d.request_id for d in engine.step() if d.finished]
    assert finished == [keep]
    assert all_blocks_free(engine)


def test_a_higher_priority_request_preempts_and_the_preempted_one_resumes_unchanged(make_engine):
    """The priority policy (vLLM's): with one seat, a higher-priority arrival preempts the
    running request, which is recomputed after it and greedily writes what it would have
    undisturbed (fcfs, which lets the arrival wait: tests/engine/test_scheduler.py)."""
    story = "Tell me a long story about dragons"
    low = SamplingParams(temperature=0.0, max_tokens=12, priority=1)
    high = SamplingParams(temperature=0.0, max_tokens=4)
    engine = make_engine(max_num_seqs=1, policy="priority")
    want = [o.token_ids for o in engine.generate([story, PROMPT], [low, high])]  # one after the other
    first = engine.add_request(story, low)
    tokens, order = {first: []}, []
    for _ in range(3):
        for d in engine.step():
            tokens[d.request_id] += d.token_ids
    second = engine.add_request(PROMPT, high)
    tokens[second] = []
    while engine.has_unfinished:
        for d in engine.step():
            tokens[d.request_id] += d.token_ids
            if d.finished:
                order.append(d.request_id)
    assert [tokens[first], tokens[second]] == want
    assert order == [second, first] and engine.scheduler.num_preemptions == 1
    assert all_blocks_free(engine)
    engine.close()


def test_chat_template_prompt(engine):
    ids = engine.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    out = engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=16))[0]
    assert "4" in out.text


class _CopyInFlight:
    """Stands in for the CUDA event of a KV copy still running (the receiver's `ready`)."""

    def __init__(self) -> None:
        self.done = False
        self.waited = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited += 1
        self.done = True


def _prefilled(engine, make_engine, prompt: str, request_id: str, params: SamplingParams) -> int:
    """Reserve `request_id` here, write its prompt's KV from another engine; the first token."""
    prefill = make_engine()
    rid = prefill.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1), hold_kv=True)
    (last,) = [d for _ in range(4) for d in prefill.step()]
    dst = engine.reserve(WorkerRequest(request_id, tuple(engine.tokenize(prompt)), params))
    engine.pool.kv[:, :, dst] = prefill.pool.kv[:, :, list(last.held_block_ids)]
    assert prefill.release(rid)
    return last.token_ids[0]


def test_a_request_whose_kv_is_still_copying_waits_outside_the_batch(engine, make_engine):
    """Direct writes resolve while the copy runs: the request must not run (nor be found by a
    prefix hit) before its event completes, and nobody else may wait for it meanwhile."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = engine.generate([PROMPT], params)[0].token_ids
    other = engine.add_request("Once upon a time", SamplingParams(temperature=0.0, max_tokens=30))
    first = _prefilled(engine, make_engine, PROMPT, "copying", params)
    copy = _CopyInFlight()
    engine.admit_prefilled("copying", first, copy)
    ran = [d.request_id for _ in range(4) for d in engine.step()]
    assert set(ran) == {other} and len(ran) >= 3  # the other one runs, unhindered (one step late when overlapped)
    assert engine.load().num_receiving == 1 and copy.waited == 0
    copy.done = True
    got = [first]
    while engine.has_unfinished:
        got += [t for d in engine.step() if d.request_id == "copying" for t in d.token_ids]
    assert got == want
    assert all_blocks_free(engine)


def test_with_nothing_else_to_run_the_engine_waits_for_the_copy(engine, make_engine):
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    first = _prefilled(engine, make_engine, PROMPT, "alone", params)
    copy = _CopyInFlight()
    engine.admit_prefilled("alone", first, copy)
    assert engine.has_unfinished
    ran = [d.request_id for _ in range(2) for d in engine.step()]  # overlapped: the tokens come one call late
    assert ran[0] == "alone" and copy.waited == 1
    while engine.has_unfinished:
        engine.step()
    assert all_blocks_free(engine)


def test_aborting_a_request_whose_kv_is_copying_frees_its_blocks_after_the_copy(engine, make_engine):
    params = SamplingParams(temperature=0.0, max_tokens=3)
    first = _prefilled(engine, make_engine, PROMPT, "gone", params)
    copy = _CopyInFlight()
    engine.admit_prefilled("gone", first, copy)
    with pytest.raises(ValueError, match="not waiting for its KV"):
        engine.admit_prefilled("gone", first)  # admitted once already
    assert engine.abort("gone")
    assert copy.waited == 1  # the blocks went back only once nothing could still write them
    assert not engine.has_unfinished and all_blocks_free(engine) and engine.load().num_receiving == 0


def test_the_kv_computed_callback_fires_once_per_held_prompt_at_its_last_chunk(make_engine, tokenizer):
    """A prefill worker sends the KV from this callback, while the first token is sampled."""
    prefill = make_engine(max_num_batched_tokens=64)  # a 150-token prompt takes three steps
    calls: list[tuple[str, tuple[int, ...], object, int]] = []
    prefill.set_kv_computed_callback(lambda rid, ids, event: calls.append((rid, ids, event, step)))
    held = prefill.add_request(prompt_ids(tokenizer, 150), SamplingParams(temperature=0.0, max_tokens=1),
                               hold_kv=True)
    prefill.add_request(prompt_ids(tokenizer, 40, variant=1), SamplingParams(temperature=0.0, max_tokens=3))
    last = {}
    for step in range(8):
        last.update({d.request_id: d for d in prefill.step()})
    assert [(rid, event) for rid, _, event, _ in calls] == [(held, None)]  # CPU: the KV is complete at once
    assert calls[0][1] == last[held].held_block_ids  # the blocks the transfer will name
    assert calls[0][3] == 2  # the third step, which computed the prompt's last chunk
    assert prefill.release(held)


class _CopyThatNeverEnds(_CopyInFlight):
    """A copy from a process that died: its event never completes."""

    def synchronize(self) -> None:
        self.waited += 1
        threading.Event().wait()


def test_a_copy_that_never_ends_delays_an_abort_by_a_bound_only(engine, make_engine, monkeypatch):
    cache = dataclasses.replace(engine.config.cache, kv_copy_wait_s=0.2)
    monkeypatch.setattr(engine.handoff, "config", dataclasses.replace(engine.config, cache=cache))
    params = SamplingParams(temperature=0.0, max_tokens=3)
    first = _prefilled(engine, make_engine, PROMPT, "orphan", params)
    copy = _CopyThatNeverEnds()
    engine.admit_prefilled("orphan", first, copy)
    assert engine.step() == [] and copy.waited == 1  # nothing else runs: a bounded wait, not a hang
    assert engine.abort("orphan")
    assert not engine.has_unfinished and all_blocks_free(engine) and engine.load().num_receiving == 0


def test_a_reservation_takes_what_the_load_says_it_may(make_engine, tokenizer):
    """The KV-headroom rule has one home (Scheduler.num_reservable_blocks): the load the router
    reads says it, and the engine's reservations follow it exactly, a block of headroom kept
    for each sequence receiving (as for each running)."""
    engine = make_engine(num_blocks=12)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    taken = []
    for i in range(6):
        prompt = prompt_ids(tokenizer, 40, variant=i)  # 3 blocks of 16
        may = engine.load().num_reservable_blocks
        assert may == engine.block_manager.num_free_blocks - len(taken)
        if may < 3:
            with pytest.raises(NoCapacity, match="not enough free KV blocks"):
                engine.reserve(WorkerRequest(f"r{i}", tuple(prompt), params))
            break
        taken.append(engine.reserve(WorkerRequest(f"r{i}", tuple(prompt), params)))
    assert len(taken) == 3  # 12 blocks: 3 + 3 + 3 taken, 3 free less 3 of headroom
    for i in range(len(taken)):
        engine.abort(f"r{i}")
    assert engine.block_manager.num_free_blocks == 12
