"""Issue 39's measure: a multi-turn chat workload whose context is several times what the
device pools hold, through `pdserve bench --dataset multi-turn`, on three servers:

    (a) prefix-blind routing (round robin), no tiers below the pools
    (b) routing on the KV index (prefix_aware), no tiers
    (c) (b) plus a host-memory and a disk tier on every worker

    python -m benchmarks.multi_turn [--conversations 24] [--turns 4] [--oversubscription 4]

Two prefill workers and one decode worker (disaggregated, KV over UCX), each pool sized to
`--num-blocks` or, by default, so that the workload's distinct context (shared system prompts
counted once) is `--oversubscription` times what the two prefill pools hold. Each server is
started in this process (its own event-loop thread, a local Ray cluster of 8 logical CPUs so
that three one-CPU actors fit on a small machine) and driven by `pdserve bench`'s own CLI,
greedy, so all three see the same conversations and answers. Prints one table: prompt tokens
computed (the prompt less what the server's caches gave, as each response's usage says),
TTFT p50/p99, throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import tempfile
import threading
from pathlib import Path
from typing import Any

from benchmarks.serving import hop_means, hop_sums
from pdserve.cluster.bench.conversations import MultiTurnWorkload
from pdserve.cluster.cli import main as pdserve
from pdserve.cluster.ray_driver import init_ray
from pdserve.cluster.server import Server, start_server
from pdserve.cluster.settings.config import config_from_dict
from pdserve.engine.config import DEFAULT_MODEL

NUM_PREFILL = 2
VOCAB = 49152  # the default model's; the bench asks the server, this only sizes the pools


def _configs(args: argparse.Namespace, num_blocks: int, disk_root: Path) -> dict[str, dict[str, Any]]:
    base: dict[str, Any] = {
        "engine": {"model": {"source": args.model, "device": "cpu"}, "cache": {"num_blocks": num_blocks}},
        "server": {"port": 0, "http": False, "metrics_port": 0},
        "pools": {"num_prefill": NUM_PREFILL, "num_decode": 1, "gpus_per_worker": 0},
        "admission": {"max_waiting_per_worker": 1024},
        # A request in flight weighs as this workload's prompts do (the default, 4,096 tokens,
        # is a long prompt's: a prefix of a few hundred tokens would never outweigh one request).
        "router": {"queued_tokens_per_request": args.tokens_per_request, "kv_usage_weight": args.kv_usage_weight},
    }
    tiers = {"host_bytes": args.host_mib << 20, "disk_dir": str(disk_root), "disk_bytes": args.disk_mib << 20,
             "disk_persist": False}
    return {
        "a": _merged(base, {"pools": {"routing": "round_robin"}}),
        "b": _merged(base, {"pools": {"routing": "prefix_aware"}}),
        "c": _merged(base, {"pools": {"routing": "prefix_aware"}, "engine": {"kv_tiers": tiers}}),
    }


def _merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = {k: dict(v) for k, v in base.items()}
    for section, values in extra.items():
        for key, value in values.items():
            if isinstance(value, dict) and isinstance(out.get(section, {}).get(key), dict):
                out[section][key] = {**out[section][key], **value}
            else:
                out.setdefault(section, {})[key] = value
    return out


class _Background:
    """A server on an event loop of its own thread, so that `pdserve bench` runs as its CLI does."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.server: Server = self._run(start_server(config_from_dict(config)), 900)

    def _run(self, coro: Any, timeout_s: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self) -> None:
        self._run(self.server.stop(), 120)
        self.loop.call_soon_threadsafe(self.loop.stop)


def _bench(target: str, args: argparse.Namespace, out: Path, workload: bool) -> dict[str, Any]:
    if workload:
        flags = ["--dataset", "multi-turn", "--num-prompts", str(args.conversations), "--num-turns", str(args.turns),
                 "--num-system-prompts", str(args.system_prompts), "--system-len", str(args.system_len),
                 "--input-len", str(args.user_len), "--output-len", str(args.output_len),
                 "--max-concurrency", str(args.concurrency)]
    else:  # warm-up: one short fresh prompt per worker, seeded apart from the workload
        flags = ["--num-prompts", str(NUM_PREFILL + 1), "--input-len", "16", "--output-len", "2", "--seed", "99"]
    rc = pdserve(["bench", "--target", target, "--temperature", "0", "--no-progress", "--json", str(out), *flags])
    if rc != 0:
        raise SystemExit(f"pdserve bench failed ({rc})")
    return json.loads(out.read_text())["runs"][0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--conversations", type=int, default=24)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-prompts", type=int, default=4)
    p.add_argument("--system-len", type=int, default=256)
    p.add_argument("--user-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=2,
                   help="requests in flight (the decode pool, as small as the others, must seat them)")
    p.add_argument("--oversubscription", type=float, default=4.0)
    p.add_argument("--num-blocks", type=int, default=None, help="blocks per pool (default: from --oversubscription)")
    p.add_argument("--tokens-per-request", type=float, default=256.0, help="router.queued_tokens_per_request")
    p.add_argument("--kv-usage-weight", type=float, default=4.0, help="router.kv_usage_weight")
    p.add_argument("--host-mib", type=int, default=96, help="(c): host tier per worker")
    p.add_argument("--disk-mib", type=int, default=4096, help="(c): disk tier per worker")
    p.add_argument("--configs", default="a,b,c")
    p.add_argument("--json", type=Path, default=None, help="write the three runs' figures here")
    args = p.parse_args()

    workload = MultiTurnWorkload(args.conversations, args.turns, args.system_prompts, args.system_len,
                                 args.user_len, args.output_len, VOCAB)
    block_size = 16
    num_blocks = args.num_blocks or math.ceil(
        workload.distinct_context_tokens / block_size / args.oversubscription / NUM_PREFILL)
    print(f"workload: {workload.num_requests} requests, distinct context {workload.distinct_context_tokens} tokens "
          f"= {workload.distinct_context_tokens / (NUM_PREFILL * num_blocks * block_size):.1f}x the "
          f"{NUM_PREFILL} prefill pools ({num_blocks} blocks of {block_size} each)", flush=True)
    init_ray(None, "127.0.0.1", num_cpus=8)
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="pdserve-multi-turn-") as tmp:
        configs = _configs(args, num_blocks, Path(tmp, "kv-disk"))
        for name in args.configs.split(","):
            srv = _Background(configs[name])
            try:
                target = f"127.0.0.1:{srv.server.port}"
                _bench(target, args, Path(tmp, "warm.json"), workload=False)
                before = hop_sums(srv.server.metrics)
                runs[name] = _bench(target, args, Path(tmp, f"{name}.json"), workload=True)
                runs[name].update(_tier_hits(srv.server))
                hops = hop_means(before, hop_sums(srv.server.metrics))
                runs[name].update({f"hop_{hop}_ms": ms for hop, ms in hops.items()})
                print(f"{_LABELS[name]}: first token by hop (server, mean ms): "
                      + ", ".join(f"{hop} {ms:.0f}" for hop, ms in hops.items()), flush=True)
            finally:
                srv.stop()
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    print(_table(runs))


def _tier_hits(server: Server) -> dict[str, float]:
    """Prompt tokens the workers onboarded from each tier below their pools (`hit_tokens_<tier>`)."""
    hits: dict[str, float] = {}
    for family in server.metrics.registry.collect():
        if family.name == "pdserve_kv_tier_hit_tokens":
            for sample in family.samples:
                key = f"hit_tokens_{sample.labels['tier']}"
                hits[key] = hits.get(key, 0.0) + sample.value
    return hits


_LABELS = {"a": "(a) round robin, no tiers", "b": "(b) KV index", "c": "(c) KV index + host + disk"}


def _table(runs: dict[str, dict[str, Any]]) -> str:
    head = (f"| {'config':<28} | computed prompt tok/req | cached tok | TTFT p50 ms | TTFT p99 ms "
            f"| req/s | out tok/s | from host / disk tok | failed |")
    lines = [head, "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"]
    for name, r in runs.items():
        lines.append(f"| {_LABELS[name]:<28} | {r['mean_computed_prompt_tokens']:>23.1f} | "
                     f"{r['total_cached_tokens']:>10} | {r['median_ttft_ms']:>11.0f} | {r['p99_ttft_ms']:>11.0f} "
                     f"| {r['request_throughput']:>5.2f} | {r['output_throughput']:>9.1f} "
                     f"| {r.get('hit_tokens_host', 0):>9.0f} / {r.get('hit_tokens_disk', 0):>8.0f} "
                     f"| {r['failed']:>6} |")
    if "a" in runs and "c" in runs:
        a, c = runs["a"], runs["c"]
        computed = c["mean_computed_prompt_tokens"] / a["mean_computed_prompt_tokens"]
        lines.append(f"(c)/(a): computed prompt tokens {computed:.2f} (goal <= 0.5), "
                     f"TTFT p50 {a['median_ttft_ms'] / c['median_ttft_ms']:.2f}x lower (goal >= 1.5)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
