"""Frontend processes' throughput, and how it grows from 1 to N frontends, in one run.

    python -m benchmarks.frontend [--frontends 1,2] [--concurrency 32] [--num-requests 96]
                                  [--output-len 128] [--num-decode 1]

A scaled-out server (`pdserve serve --frontends N`: a control plane and N frontend processes)
over colocated workers of a tiny random Llama (1 layer, hidden 64) that carries the default
model's tokenizer: the workers generate as fast as a CPU can step such a model, so the
frontends' own work (gRPC, detokenizing every token, the streams' bookkeeping) is what
limits. For each N, one client per frontend (gRPC, `pdserve bench`'s backend, at most
`--concurrency` requests in flight each, greedy, EOS ignored) sends `--num-requests` requests
of random prompt ids at once, all frontends driven together. Prints per N: requests/s,
streamed tokens/s and chunks/s per frontend and in all, tokens per chunk (above 1 where
streams fell behind and their deltas were merged), and the total against N = 1 measured in
the same run. The clients run in this process: on a machine of few cores they compete with
the frontends and workers for the same CPUs (the load average is printed).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
import uuid
from pathlib import Path

from pdserve.cluster.bench.backends import GrpcBackend, RequestResult
from pdserve.cluster.bench.dataset import random_requests
from pdserve.cluster.bench.runner import LoadShape, run_load
from pdserve.cluster.scale_out import start_scaled_out
from pdserve.cluster.settings.config import config_from_dict


def tiny_model(folder: Path) -> Path:
    """A 1-layer random Llama with the default model's tokenizer, saved as a checkpoint folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pdserve.engine.config import ModelConfig
    from pdserve.engine.models.weights import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(ModelConfig(source="default")))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


async def one_size(model: Path, num_frontends: int, args: argparse.Namespace) -> list[tuple[float, float, float, int]]:
    """(requests/s, tokens/s, chunks/s, failed) per frontend, driven together."""
    config = config_from_dict({
        "engine": {"model": {"source": str(model), "device": "cpu", "dtype": "float32"},
                   "cache": {"cpu_kv_cache_gib": 0.5}, "scheduler": {"max_num_seqs": 256}},
        "server": {"port": 0, "http_port": 0, "metrics_port": 0, "frontends": num_frontends, "control_plane": True},
        "pools": {"mode": "colocated", "num_decode": args.num_decode, "gpus_per_worker": 0},
        "admission": {"max_waiting_per_worker": 4096},
        "ray": {"namespace": f"bench-frontend-{uuid.uuid4().hex[:8]}"}})
    scaled = await start_scaled_out(config)
    backends = [GrpcBackend(f"127.0.0.1:{f.port}", temperature=0.0) for f in scaled.infos]
    try:
        vocab = await backends[0].vocab_size()
        warm = random_requests(4, args.prompt_len, 8, vocab, seed=99)
        await asyncio.gather(*(run_load(b, warm, LoadShape(), progress=False) for b in backends))
        runs = await asyncio.gather(*(
            run_load(b, random_requests(args.num_requests, args.prompt_len, args.output_len, vocab, seed=i),
                     LoadShape(max_concurrency=args.concurrency), progress=False)
            for i, b in enumerate(backends)))
    finally:
        for b in backends:
            await b.close()
        await scaled.stop()
    rows = []
    for run in runs:
        ok: list[RequestResult] = [r for r in run.results if r.ok]
        tokens = sum(r.output_tokens for r in ok)
        chunks = sum(len(r.chunk_times) for r in ok)
        rows.append((len(ok) / run.duration_s, tokens / run.duration_s, chunks / run.duration_s,
                     len(run.results) - len(ok)))
    return rows


async def main_async(args: argparse.Namespace) -> None:
    from pdserve.cluster.ray_driver import init_ray

    init_ray(None, "127.0.0.1")
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp))
        results = {}
        for n in args.frontends:
            started = time.perf_counter()
            results[n] = await one_size(model, n, args)
            print(f"{n} frontend(s): {time.perf_counter() - started:.0f} s, load average {os.getloadavg()[0]:.1f}",
                  flush=True)
    print(f"\n{args.num_decode} colocated worker(s), tiny 1-layer model; per frontend {args.num_requests} requests, "
          f"{args.concurrency} in flight, prompts {args.prompt_len}, outputs {args.output_len} tokens; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end")
    print("| frontends | frontend | failed | requests/s | tokens/s | chunks/s | tokens per chunk | total tokens/s "
          "| vs 1 frontend |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    base = sum(row[1] for row in results[min(results)])
    for n, rows in results.items():
        total = sum(row[1] for row in rows)
        for i, (rps, tps, cps, failed) in enumerate(rows):
            print(f"| {n} | f{i} | {failed} | {rps:.2f} | {tps:.0f} | {cps:.0f} | {tps / cps if cps else 0:.2f} | "
                  f"{total:.0f} | {total / base:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frontends", default="1,2", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--num-decode", type=int, default=1, help="colocated workers (each one CPU slot of Ray)")
    ap.add_argument("--concurrency", type=int, default=32, help="requests in flight per frontend")
    ap.add_argument("--num-requests", type=int, default=96, help="requests per frontend")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=128)
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
