"""`pdserve generate` as a real process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdserve.engine.sampling import SamplingParams

pytestmark = pytest.mark.slow


def pdserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdserve.cluster.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_generate_prints_the_engines_greedy_text(engine):
    want = engine.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=12))[0].text
    proc = pdserve("generate", "--max-tokens", "12", "--temperature", "0", "The capital of France is")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == want + "\n"


def test_bad_flag_value_is_one_clear_line():
    proc = pdserve("generate", "--temperature", "-1", "hi")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "pdserve: error: temperature must be >= 0, got -1.0"


def test_missing_model_path():
    proc = pdserve("generate", "--model", "/no/such/model", "hi")
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_generate_with_a_json_schema():
    schema = '{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}'
    proc = pdserve("generate", "--chat", "--temperature", "0", "--max-tokens", "16", "--json-schema", schema,
                   "Is water wet? Answer in JSON.")
    assert proc.returncode == 0, proc.stderr
    assert isinstance(json.loads(proc.stdout)["ok"], bool)
    bad = pdserve("generate", "--json-schema", "[1]", "hi")
    assert bad.returncode == 2
    assert bad.stderr.strip() == "pdserve: error: response_format: a JSON schema is an object or a boolean, got list"
