"""Pools are placed by custom node resources on a real multi-node Ray cluster."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdserve.engine.sampling import SamplingParams

pytestmark = pytest.mark.slow


@pytest.mark.timeout(600)
def test_three_node_cluster_places_each_pool_on_its_node(default_engine):
    proc = subprocess.run([sys.executable, "-m", "tests.cluster.three_nodes"], capture_output=True, text=True,
                          timeout=540)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    report = json.loads(lines[-1].removeprefix("REPORT "))
    assert report["placed"]["prefill-0"] == report["prefill_node"]
    assert report["placed"]["decode-0"] == report["decode_node"]
    want = default_engine.generate(["Hello, my name is"], SamplingParams(temperature=0, max_tokens=8))[0].token_ids
    assert report["tokens"] == want
