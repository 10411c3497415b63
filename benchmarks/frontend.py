"""Frontend processes' throughput, and how it grows from 1 to N frontends, in one run.

    python -m benchmarks.frontend [--frontends 1,2] [--concurrency 32] [--num-requests 96]
                                  [--output-len 128] [--num-decode 1] [--model DIR]
    python -m benchmarks.frontend --save-model DIR   # the tiny model, for a machine without the default's

On the device machine's 16 CPU cores: `benchmarks/device_cpu_frontends.sh` (Ray from carried wheels).

A scaled-out server (`pdserve serve --frontends N`: a control plane and N frontend processes)
over colocated workers of a tiny random Llama (1 layer, hidden 64) that carries the default
model's tokenizer: the workers generate as fast as a CPU can step such a model, so the
frontends' own work (gRPC, detokenizing every token, the streams' bookkeeping) is what
limits. For each N, one client per frontend (gRPC, `pdserve bench`'s backend, at most
`--concurrency` requests in flight each, greedy, EOS ignored) sends `--num-requests` requests
of random prompt ids at once, all frontends driven together. Prints per N: requests/s,
streamed tokens/s and chunks/s per frontend and in all, tokens per chunk (above 1 where
streams fell behind and their deltas were merged), and the total against N = 1 measured in
the same run. Each frontend's client runs in a process of its own (one client process for
all would be the limit before N frontends are); on a machine of few cores they compete with
the frontends and workers for the same CPUs (the load average is printed).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import tempfile
import time
import uuid
from concurrent.futures import ProcessPoolExecutor
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


def drive(target: str, seed: int, num_requests: int, prompt_len: int, output_len: int,
          concurrency: int) -> tuple[float, float, float, int]:
    """One frontend's client, in a process of its own: (requests/s, tokens/s, chunks/s, failed)."""
    async def run() -> tuple[float, float, float, int]:
        backend = GrpcBackend(target, temperature=0.0)
        try:
            vocab = await backend.vocab_size()
            await run_load(backend, random_requests(4, prompt_len, 8, vocab, seed=99), LoadShape(), progress=False)
            done = await run_load(backend, random_requests(num_requests, prompt_len, output_len, vocab, seed=seed),
                                  LoadShape(max_concurrency=concurrency), progress=False)
        finally:
            await backend.close()
        ok: list[RequestResult] = [r for r in done.results if r.ok]
        tokens, chunks = sum(r.output_tokens for r in ok), sum(len(r.chunk_times) for r in ok)
        seconds = done.duration_s
        return len(ok) / seconds, tokens / seconds, chunks / seconds, len(done.results) - len(ok)

    return asyncio.run(run())


async def one_size(model: Path, num_frontends: int, args: argparse.Namespace,
                   clients: ProcessPoolExecutor) -> list[tuple[float, float, float, int]]:
    """(requests/s, tokens/s, chunks/s, failed) per frontend, driven together."""
    config = config_from_dict({
        "engine": {"model": {"source": str(model), "device": "cpu", "dtype": "float32"},
                   "cache": {"cpu_kv_cache_gib": 0.5}, "scheduler": {"max_num_seqs": 256}},
        "server": {"port": 0, "http_port": 0, "metrics_port": 0, "frontends": num_frontends, "control_plane": True},
        "pools": {"mode": "colocated", "num_decode": args.num_decode, "gpus_per_worker": 0},
        "admission": {"max_waiting_per_worker": 4096},
        "ray": {"namespace": f"bench-frontend-{uuid.uuid4().hex[:8]}"}})
    scaled = await start_scaled_out(config)
    loop = asyncio.get_running_loop()
    try:
        return list(await asyncio.gather(*(
            loop.run_in_executor(clients, drive, f"127.0.0.1:{f.port}", i, args.num_requests, args.prompt_len,
                                 args.output_len, args.concurrency) for i, f in enumerate(scaled.infos))))
    finally:
        await scaled.stop()


async def main_async(args: argparse.Namespace) -> None:
    from pdserve.cluster.ray_driver import init_ray

    init_ray(None, "127.0.0.1")
    spawn = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp, ProcessPoolExecutor(max(args.frontends), spawn) as clients:
        model = args.model or tiny_model(Path(tmp))
        results = {}
        for n in args.frontends:
            started = time.perf_counter()
            results[n] = await one_size(model, n, args, clients)
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
    ap.add_argument("--model", type=Path, help="the tiny model's folder (--save-model's); default: built now")
    ap.add_argument("--save-model", type=Path, help="only build the tiny model into this folder, and exit")
    args = ap.parse_args()
    if args.save_model:
        print(f"tiny model saved in {tiny_model(args.save_model)}")
        return
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
