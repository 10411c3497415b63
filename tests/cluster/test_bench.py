"""`pdserve bench` against a real server (CPU, the small model, real gRPC): its counts match
the server's /metrics, its JSON has vllm bench serve's names, and its plots are PNGs."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from pdserve.cluster.bench.dataset import SYNTHETIC_CHAT, jsonl_requests, random_requests
from pdserve.cluster.cli import main

pytestmark = pytest.mark.slow


def test_random_requests_have_the_asked_lengths_and_are_seeded():
    a = random_requests(20, 100, 8, vocab_size=1000, range_ratio=0.5, seed=3)
    assert a == random_requests(20, 100, 8, vocab_size=1000, range_ratio=0.5, seed=3)
    assert all(50 <= len(r.prompt_ids) <= 150 and 4 <= r.output_len <= 12 for r in a)
    assert all(10 <= t < 990 for r in a for t in r.prompt_ids)
    assert len({len(r.prompt_ids) for r in a}) > 1
    with pytest.raises(ValueError, match="range ratio"):
        random_requests(1, 10, 1, 1000, range_ratio=1.0)


def test_the_shipped_chat_set_is_chat_shaped(tmp_path):
    requests = jsonl_requests(SYNTHETIC_CHAT, 300, output_len=16)  # more than its 200 lines: cycled
    assert len(requests) == 300 and all(r.messages and r.messages[-1]["role"] == "user" for r in requests)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"nothing": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        jsonl_requests(bad, 2, 4)


@pytest.fixture(scope="module")
def srv(disaggregated_server):
    return disaggregated_server  # the default config, /metrics on: its metrics_url


def test_bench_counts_match_the_servers_metrics(srv, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(["bench", "--target", srv.target, "--num-prompts", "6", "--input-len", "24", "--output-len", "5",
               "--sweep", "4,inf", "--max-concurrency", "3", "--goodput", "ttft:60000",
               "--metrics-url", srv.metrics_url,
               "--json", str(out), "--plot", str(tmp_path / "plots"), "--no-progress"])
    assert rc == 0
    table = capsys.readouterr().out
    assert table.count("Successful requests:                    6") == 2
    doc = json.loads(out.read_text())
    assert [run["request_rate"] for run in doc["runs"]] == [4.0, "inf"]
    for run in doc["runs"]:
        assert run["completed"] == 6 and run["failed"] == 0
        assert run["total_input_tokens"] == 6 * 24 and run["total_output_tokens"] == 6 * 5
        # The server counted the same requests and tokens.
        assert run["server_completed"] == 6 and run["server_output_tokens"] == 6 * 5
        assert run["request_goodput"] == pytest.approx(run["request_throughput"])
        for name in ("ttft", "tpot", "itl", "e2el"):
            assert 0 < run[f"median_{name}_ms"] <= run[f"p99_{name}_ms"]
        assert run["median_ttft_ms"] <= run["median_e2el_ms"]
    pngs = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert pngs == ["latency_cdf_0_rate_4.png", "latency_cdf_1_rate_inf.png", "sweep.png"]
    for name in pngs:
        with Image.open(tmp_path / "plots" / name) as image:
            assert image.format == "PNG" and image.size[0] > 500


@pytest.mark.parametrize("api", ["grpc", "openai"])
def test_bench_over_either_api_counts_what_the_server_counts(srv, api, tmp_path):
    from pdserve.cluster.clients.grpc_client import Client

    with Client(srv.target) as client:
        vocab = client.list_models().models[0].vocab_size
    target = srv.target if api == "grpc" else srv.http_url
    for dataset in ("random", "synthetic-chat"):
        out = tmp_path / f"{dataset}.json"
        assert main(["bench", "--target", target, "--dataset", dataset, "--num-prompts", "4", "--input-len", "16",
                     "--output-len", "4", "--vocab-size", str(vocab), "--max-concurrency", "2",
                     "--metrics-url", srv.metrics_url, "--json", str(out), "--no-progress"]) == 0
        doc = json.loads(out.read_text())
        assert doc["backend"] == api
        (run,) = doc["runs"]
        assert run["completed"] == 4 and run["total_output_tokens"] == 16
        assert run["server_completed"] == 4 and run["server_output_tokens"] == 16
        # Prompt tokens as the server counted them (random: exactly the ids sent).
        counts = [r["input_tokens"] for r in doc["requests"]]
        assert counts == [16] * 4 if dataset == "random" else all(c > 10 for c in counts)


def test_bench_chat_set_and_a_bad_target(srv, tmp_path, capsys):
    out = tmp_path / "chat.json"
    assert main(["bench", "--target", srv.target, "--dataset", "synthetic-chat", "--num-prompts", "3",
                 "--output-len", "4", "--json", str(out), "--no-progress"]) == 0
    doc = json.loads(out.read_text())
    (run,) = doc["runs"]
    assert run["completed"] == 3
    assert all(r["input_tokens"] > 10 for r in doc["requests"])  # the server's count of the templated chat
    assert main(["bench", "--target", srv.target, "--dataset", str(tmp_path / "missing.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_multi_turn_conversations_resend_their_history_and_count_what_the_caches_gave(srv, tmp_path, capsys):
    out = tmp_path / "multi.json"
    assert main(["bench", "--target", srv.target, "--dataset", "multi-turn", "--num-prompts", "3", "--num-turns", "3",
                 "--num-system-prompts", "2", "--system-len", "32", "--input-len", "16", "--output-len", "4",
                 "--max-concurrency", "2", "--temperature", "0", "--json", str(out), "--no-progress"]) == 0
    assert "Computed prompt tokens per request:" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    (run,) = doc["runs"]
    assert run["completed"] == 9 and run["failed"] == 0
    # Conversation by conversation: turn k+1's prompt is turn k's, its 4-token answer and 16 more.
    lengths = [r["input_tokens"] for r in doc["requests"]]
    assert lengths == [48, 68, 88] * 3
    answers = [r["output_ids"] for r in doc["requests"]]
    assert all(len(a) == 4 for a in answers)
    # A later turn finds at least its system prompt's 2 blocks in the server's prefix cache.
    later = [r["cached_tokens"] for i, r in enumerate(doc["requests"]) if i % 3]
    assert all(c >= 32 for c in later)
    assert run["total_computed_prompt_tokens"] == sum(lengths) - run["total_cached_tokens"]
    assert main(["bench", "--target", srv.http_url, "--dataset", "multi-turn"]) == 2  # needs the token ids
    assert "gRPC" in capsys.readouterr().err
