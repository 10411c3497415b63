"""The planner of a scaled-out server runs in its control plane over the frontends' request
metrics (`serving/cluster_metrics.py`), on real processes: two frontend processes over one
prefill and two decode workers, the planner in dry run with a profile whose prefills are slow
(tests/cluster/test_planner_live.py's); requests sent through both frontends reach it (each
frontend's heartbeat carries its samples), and it decides, as a single server's does, that a
second prefill worker is wanted."""

from __future__ import annotations

import asyncio
import re
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.cluster.scale_out import start_scaled_out
from pdserve.engine.sampling import SamplingParams
from tests.cluster.conftest import _server_config
from tests.cluster.streams import collect, wait_until
from tests.cluster.test_planner_live import COSTS
from tests.engine.prompts import prompt_ids

pytestmark = pytest.mark.slow


def _sample(text: str, name: str) -> float | None:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(match[1]) if match else None


def test_the_control_plane_plans_from_both_frontends_requests(ray_cluster, small_model, tokenizer, tmp_path):
    import ray

    profile = tmp_path / "profile.json"
    COSTS.save(profile)
    planner = {"enabled": True, "dry_run": True, "profile": str(profile), "ttft_target_ms": 2000,
               "itl_target_ms": 1000, "interval_s": 0.5, "window_s": 30, "hysteresis": 1, "min_requests": 2,
               "sim_requests": 100, "correction_intervals": 0}
    config = _server_config(small_model, pools={"mode": "disaggregated", "num_prefill": 1, "num_decode": 2,
                                                "planner": planner},
                            server={"frontends": 2, "metrics_port": 0},
                            ray={"namespace": f"frontends-planner-{uuid.uuid4().hex[:8]}"})
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    scaled = asyncio.run_coroutine_threadsafe(start_scaled_out(config), loop).result(600)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        prompts = [prompt_ids(tokenizer, 50 + 3 * i, variant=60 + i) for i in range(8)]
        targets = [f"127.0.0.1:{f.port}" for f in scaled.infos]
        with ThreadPoolExecutor(4) as pool:
            done = list(pool.map(lambda i: collect(targets[i % 2], prompts[i], params), range(len(prompts))))
        assert all(len(d.token_ids) == 8 for d in done)

        def metrics() -> str:
            return ray.get(scaled.control_plane.metrics_text.remote(), timeout=30)

        # Both frontends' requests summed (their next heartbeats), then the planner's dry-run decision.
        wait_until(lambda: _sample(metrics(), "pdserve_cluster_requests_arrived_total") == len(prompts), 30,
                   "the cluster view to count both frontends' requests")
        wait_until(lambda: (_sample(metrics(), 'pdserve_planner_decisions_total{outcome="dry_run"}') or 0) >= 1,
                   60, "the control plane's planner to decide")
        text = metrics()
        assert _sample(text, 'pdserve_planner_target_workers{role="prefill"}') == 2
        assert _sample(text, 'pdserve_planner_target_workers{role="decode"}') == 1
    finally:
        asyncio.run_coroutine_threadsafe(scaled.stop(), loop).result(120)
        loop.call_soon_threadsafe(loop.stop)
