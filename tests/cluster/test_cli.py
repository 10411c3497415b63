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


def test_generate_prints_the_engines_greedy_text(default_engine):
    want = default_engine.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=12))[0].text
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


def test_serve_flags_land_in_the_config_sections():
    proc = pdserve("serve", "--check-config", "--max-waiting-per-worker", "7", "--retry-after-s", "2.5",
                   "--max-migrations", "0", "--migration-wait-s", "9", "--transfer-timeout-s", "11",
                   "--routing", "least_load", "--api-key-file", "token", "--kv-require", "rdma")
    assert proc.returncode == 0, proc.stderr
    for words in ("max_waiting_per_worker=7", "retry_after_s=2.5", "max_migrations=0", "migration_wait_s=9.0",
                  "transfer_timeout_s=11.0", "routing='least_load'", "api_key_file='token'", "require='rdma'",
                  "LoopConfig(idle_wait_s=0.05"):
        assert words in proc.stdout, words


def test_a_bad_mode_is_the_configs_one_clear_line():
    proc = pdserve("serve", "--check-config", "--mode", "mixed")
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("pdserve: error: --mode: PoolConfig.mode must be one of "
                                   "('disaggregated', 'colocated'), got 'mixed'")


def test_generate_with_a_json_schema():
    schema = '{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}'
    proc = pdserve("generate", "--chat", "--temperature", "0", "--max-tokens", "16", "--json-schema", schema,
                   "Is water wet? Answer in JSON.")
    assert proc.returncode == 0, proc.stderr
    assert isinstance(json.loads(proc.stdout)["ok"], bool)
    bad = pdserve("generate", "--json-schema", "[1]", "hi")
    assert bad.returncode == 2
    assert bad.stderr.strip() == "pdserve: error: response_format: a JSON schema is an object or a boolean, got list"
