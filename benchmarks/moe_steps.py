"""A Mixture-of-Experts engine's prefill and decode steps on one GPU (fits an 80 GB card):
this tree against a baseline tree, same run, same device.

    python -m benchmarks.moe_steps [--baseline PATH] [--model dummy:qwen3-30b-a3b] [--num-blocks 6144]
        [--quantization fp8]

Each tree runs in a subprocess of its own, its packages importable as `pdserve.*` from the
tree itself (a `pdserve` link to it on PYTHONPATH), e.g. `--baseline` a `git worktree add
/tmp/base main`. Figures, random token ids, dummy weights:
- prefill: one fresh prompt alone (512, 2,048, 4,096 tokens), wall time to its first token,
  median of 5;
- decode step: `engine.step()` back to back over 20 steps at batch 1, 64 and 256, 256-token
  prompts, random sampling (the decode graphs), beside its byte limit: the bytes a step
  must read (every weight but the embedding table, each MoE layer's experts as many as B
  tokens of top-k pick under uniform routing, E (1 - (1 - k/E)^B), and the batch's KV)
  over the device copy rate measured in the same process.
benchmarks/hotpath.py measures more (single stream, offline throughput) but needs the KV
room of an H200 at this model's size.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PREFILL = (512, 2048, 4096)
BATCHES = (1, 64, 256)
DECODE_PROMPT = 256  # tokens of each decoding sequence's prompt


def _step_bytes(engine, batch: int, context: int) -> float:
    """Bytes a decode step of `batch` sequences at `context` tokens must read (module docstring)."""
    arch, model = engine.arch, engine.model
    weights = experts = 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name and not arch.tie_word_embeddings:
            continue
        if ".experts." in name:
            experts += p.numel() * p.element_size()
        else:
            weights += p.numel() * p.element_size()
    moe = arch.moe
    touched = 1.0 if moe is None else 1 - (1 - moe.top_k / moe.num_experts) ** batch
    kv = engine.pool.layout.bytes_per_block / engine.pool.layout.block_size
    return weights + experts * touched + batch * context * kv


def _copy_bw() -> float:
    """Device-to-device copy of 1 GiB, bytes read + written per second (median of 10)."""
    import torch

    src = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    times = []
    for _ in range(11):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.nbytes / statistics.median(times[1:])


def measure(model: str, num_blocks: int, quantization: str | None = None) -> dict[str, float | str]:
    """Every figure for the tree `pdserve` resolves to (runs in the worker process)."""
    import torch

    from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from pdserve.engine.engine import Engine
    from pdserve.engine.sampling import SamplingParams

    engine = Engine(EngineConfig(model=ModelConfig(source=model, device="cuda", quantization=quantization),
                                 cache=CacheConfig(enable_prefix_caching=False, num_blocks=num_blocks),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=max(BATCHES))))
    rng = random.Random(0)

    def ids(n: int) -> list[int]:
        return [rng.randrange(10, engine.arch.vocab_size - 10) for _ in range(n)]

    def prefill(n: int) -> float:
        engine.add_request(ids(n), SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        torch.cuda.synchronize()
        start = time.perf_counter()
        while engine.has_unfinished:
            engine.step()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3

    def decode_step(batch: int) -> float:
        params = SamplingParams(temperature=1.0, max_tokens=200, ignore_eos=True)
        rids = [engine.add_request(ids(DECODE_PROMPT), params) for _ in range(batch)]
        while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_tokens - 1
                                              for s in engine.scheduler.running):
            engine.step()
        for _ in range(5):
            engine.step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            engine.step()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - start) / 20 * 1e3
        for rid in rids:
            engine.abort(rid)
        while engine.has_unfinished:
            engine.step()
        return ms

    for n in PREFILL:  # compile every kernel variant first
        prefill(n)
    out = {f"prefill_{n}_ms": statistics.median(prefill(n) for _ in range(5)) for n in PREFILL}
    out.update({f"decode_step_{b}_ms": decode_step(b) for b in BATCHES})
    copy_bw = _copy_bw()
    out["copy_tb_s"] = copy_bw / 1e12
    # The timed steps run at contexts of DECODE_PROMPT + 6 .. + 25 tokens.
    out.update({f"decode_step_{b}_limit_ms": _step_bytes(engine, b, DECODE_PROMPT + 16) / copy_bw * 1e3
                for b in BATCHES})
    out["device"] = torch.cuda.get_device_name()
    return out


def _run_tree(tree: Path, args: argparse.Namespace) -> dict[str, float]:
    with tempfile.NamedTemporaryFile(suffix=".json") as f, tempfile.TemporaryDirectory() as links:
        (Path(links) / "pdserve").symlink_to(tree, target_is_directory=True)
        env = dict(os.environ, PYTHONPATH=links, PYTHONUNBUFFERED="1")
        argv = [__file__, "--worker", f.name, "--model", args.model, "--num-blocks", str(args.num_blocks)]
        argv += ["--quantization", args.quantization] if args.quantization else []
        # Run by path without its folder on sys.path (benchmarks/kernels.py would shadow `kernels`).
        code = f"import runpy, sys; sys.argv = {argv!r}; runpy.run_path(sys.argv[0], run_name='__main__')"
        if subprocess.run([sys.executable, "-c", code], cwd=tree, env=env).returncode:
            print(f"{tree}: failed (above); its column stays empty", flush=True)
            return {}
        return json.loads(Path(f.name).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, help="another checkout to measure in the same run")
    parser.add_argument("--model", default="dummy:qwen3-30b-a3b")
    parser.add_argument("--num-blocks", type=int, default=6144, help="KV blocks (16 tokens each)")
    parser.add_argument("--quantization", choices=["fp8"], help="weights quantized at load (ModelConfig)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        Path(args.worker).write_text(json.dumps(measure(args.model, args.num_blocks, args.quantization)))
        return
    here = Path(__file__).resolve().parents[1]
    trees = ([("baseline", args.baseline.resolve())] if args.baseline else []) + [("this tree", here)]
    results = {name: _run_tree(tree, args) for name, tree in trees}
    names = list(results)
    device = next((r["device"] for r in results.values() if "device" in r), "?")
    print(f"\n{args.model}{', FP8 weights' if args.quantization else ''}, one GPU ({device}), "
          f"{args.num_blocks} KV blocks")
    print("| figure | " + " | ".join(names) + " | byte limit | limit / last |")
    print("|---|" + "---:|" * (len(names) + 2))
    last = results[names[-1]]
    for key in [f"prefill_{n}_ms" for n in PREFILL] + [f"decode_step_{b}_ms" for b in BATCHES]:
        limit = last.get(key.replace("_ms", "_limit_ms"))
        share = f"{limit / last[key]:.0%}" if limit and key in last else ""
        print(f"| {key} | " + " | ".join(f"{results[n][key]:.2f}" if key in results[n] else "-" for n in names)
              + f" | {f'{limit:.2f}' if limit else ''} | {share} |")
    if "copy_tb_s" in last:
        print(f"copy {last['copy_tb_s']:.2f} TB/s (read + write), measured in the last tree's process")

if __name__ == "__main__":
    main()
