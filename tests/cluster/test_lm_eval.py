"""lm-evaluation-harness against the server (issue 38), as its users run it: its
`local-completions` backend on /v1/completions (log-likelihoods through `echo` with
`logprobs`, generations through plain completions) and its own `hf` backend on the same
model folder give the same per-choice log-likelihoods (within 1e-3, float32) on a small
multiple-choice task and the same generations on a small generative task. The tasks and
their data are files written here (no hub: `datasets`' local json loader, offline)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

TOLERANCE = 1e-3

MC_DOCS = [
    {"question": "The capital of France is", "choices": [" Paris", " Berlin", " a small river town"], "answer": 0},
    {"question": "Two plus two equals", "choices": [" four", " five"], "answer": 0},
    {"question": "The sky on a clear day is", "choices": [" blue", " green", " made of cheese"], "answer": 0},
]
GEN_DOCS = [
    {"prompt": "Q: What colour is grass?\nA:", "target": " green"},
    {"prompt": "Once upon a time, in a land far away,", "target": " there"},
]


def write_tasks(folder: Path) -> None:
    """Two task YAMLs and their jsonl data in `folder` (lm-eval's --include_path)."""
    for name, docs in (("mc", MC_DOCS), ("gen", GEN_DOCS)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = "dataset_path: json\ntest_split: test\n"
    (folder / "pdserve_mc.yaml").write_text(
        f"task: pdserve_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n")
    (folder / "pdserve_gen.yaml").write_text(
        f"task: pdserve_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{target}}'\n"
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 8\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")


@pytest.fixture(scope="module")
def srv(disaggregated_server):
    return disaggregated_server


def evaluate(model: str, model_args: dict, folder: Path) -> dict[str, list]:
    """Each task's per-document responses (after lm-eval's filters), in document order."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(model=model, model_args=model_args, tasks=["pdserve_mc", "pdserve_gen"],
                          task_manager=TaskManager(include_path=str(folder)), log_samples=True, batch_size=4,
                          num_fewshot=0, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                          fewshot_random_seed=0)
    return {task: [s["filtered_resps"] for s in sorted(samples, key=lambda s: s["doc_id"])]
            for task, samples in out["samples"].items()}


def test_local_completions_matches_the_hf_backend(srv, model, small_model, tmp_path, monkeypatch):
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    write_tasks(tmp_path)
    folder = str(small_model.folder)
    hf = evaluate("hf", {"pretrained": folder, "dtype": "float32", "device": "cpu"}, tmp_path)
    served = evaluate("local-completions", {"model": model, "base_url": srv.http_url + "/v1/completions",
                                            "tokenizer": folder, "tokenizer_backend": "huggingface",
                                            "num_concurrent": 1, "max_retries": 1}, tmp_path)
    assert [len(doc) for doc in served["pdserve_mc"]] == [len(d["choices"]) for d in MC_DOCS]
    for doc, (want, got) in enumerate(zip(hf["pdserve_mc"], served["pdserve_mc"], strict=True)):
        for choice, ((want_ll, _), (got_ll, _)) in enumerate(zip(want, got, strict=True)):
            assert abs(want_ll - got_ll) < TOLERANCE, f"doc {doc} choice {choice}: hf {want_ll}, server {got_ll}"
    assert served["pdserve_gen"] == hf["pdserve_gen"]
    assert all(g[0] for g in served["pdserve_gen"]), "the generations are meant to hold text"
