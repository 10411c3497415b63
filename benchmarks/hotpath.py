"""The engine's hot path on one GPU: this tree against a baseline tree, same run, same device.

    python -m benchmarks.hotpath [--baseline PATH] [--model dummy:llama-3.1-8b] [--offline-requests 512 [3000]]
        [--kv-cache-dtypes auto fp8] [--quantizations none fp8] [--parts decode prefill step offline]
        [--baseline-parts ...] [--num-blocks N] [--max-num-seqs 512] [--gpu-memory-utilization F] [--json PATH]

Each tree is measured in a subprocess of its own, its packages importable as `pdserve.*`
from the tree itself (a `pdserve` link to it on PYTHONPATH; a tree from before the
packages moved under `pdserve` is imported by its bare names), so `--baseline` can name
any checkout, e.g. `git worktree add /tmp/base main`; this
script relies only on the public Engine API (plus the graph of the decode bucket, to time
its replay alone). This tree runs once per `--kv-cache-dtypes` entry (the baseline at its
default) and `--quantizations` entry (weights as stored, or FP8 quantized at load). Figures,
random token ids throughout:
- decode: one stream, 1k-token prompt, greedy, 512 tokens; tokens/s after the first token.
- prefill: one fresh 4k-token prompt alone, time to its first token (best and median of 3).
- step: 256 sequences at ~1.5k context, all decoding (refused where the KV pool cannot
  hold them: Qwen3-30B-A3B in bf16 on an 80 GB card), a step's wall time back to back
  (engine.step()), one call from an idle GPU (overlapped: the host's own work), and the
  decode graph's replay alone on the GPU's clock.
- mixed: the same 256 decodes plus a fresh 512-token prompt in one step, against the
  decode step plus that chunk alone.
- offline: N requests of 1k random ids, 1k output tokens each (ignore_eos, temperature 1),
  `Engine.generate`, at most `--max-num-seqs` running (fewer where the pool holds fewer to
  the end, so none is preempted): output tokens/s; each N of `--offline-requests` in turn,
  in the same process (TensorRT-LLM's published figure runs 3,000).
`--parts` picks which of those run (default all; "step" is the batch step and mixed),
`--num-blocks` sizes the KV pool (default: the memory left at `--gpu-memory-utilization`,
the engine's 0.9 unless given), `--max-num-seqs` is the scheduler's seats and the largest
decode graph (default 512; before issue 53 offline ran at most 256 whatever the pool held).
Limits printed beside them: the weight-read bound for decode (bytes / the device's measured
copy bandwidth: 4.3 TB/s on an H200, 3.0 on an H100; a Mixture of
Experts counts the experts a token uses, top-k of them), the compute bound for prefill (~700
TFLOP/s, the active parameters). A tree that fails leaves its column empty.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COPY_BW = {"H200": 4.3e12, "H100": 3.0e12}  # bytes/s, measured device copy (read + write), KINDS.md
PEAK_FLOPS = 700e12  # bf16 dense matmul, attainable
STEP_SEQS, STEP_TOKENS = 256, 1536 + 128  # the batch step's sequences; each one's prompt and the tokens it decodes


def _prompt(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(10, vocab - 10) for _ in range(n)]


def _sync() -> None:
    import torch

    torch.cuda.synchronize()


PARTS = ("decode", "prefill", "step", "offline")


def measure(package: str, model: str, offline_requests: tuple[int, ...], profile: bool = False,
            kv_cache_dtype: str = "auto", quantization: str = "none", parts: tuple[str, ...] = PARTS,
            num_blocks: int | None = None, max_num_seqs: int = 512,
            gpu_memory_utilization: float | None = None) -> dict[str, float]:
    """Every figure for the engine package `package` (runs in the worker process)."""
    import importlib

    config = importlib.import_module(f"{package}.config")
    CacheConfig, EngineConfig, ModelConfig, SchedulerConfig = (  # noqa: N806
        config.CacheConfig, config.EngineConfig, config.ModelConfig, config.SchedulerConfig)
    Engine = importlib.import_module(f"{package}.engine").Engine  # noqa: N806
    SamplingParams = importlib.import_module(f"{package}.sampling").SamplingParams  # noqa: N806

    # A baseline from before kv_cache_dtype existed takes no such field.
    kv = {} if kv_cache_dtype == "auto" else {"kv_cache_dtype": kv_cache_dtype}
    kv |= {} if num_blocks is None else {"num_blocks": num_blocks}
    kv |= {} if gpu_memory_utilization is None else {"gpu_memory_utilization": gpu_memory_utilization}
    quant = {} if quantization == "none" else {"quantization": quantization}
    engine = Engine(EngineConfig(model=ModelConfig(source=model, device="cuda", **quant),
                                 cache=CacheConfig(enable_prefix_caching=False, **kv),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=max_num_seqs)))
    arch = engine.arch
    vocab = arch.vocab_size
    rng = random.Random(0)
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    num_params = sum(p.numel() for p in engine.model.parameters())
    import torch

    name = torch.cuda.get_device_name()
    copy_bw = next((bw for chip, bw in COPY_BW.items() if chip in name), COPY_BW["H200"])
    out: dict[str, float] = {"weight_bytes": float(weight_bytes), "num_params": float(num_params),
                             "copy_bw": copy_bw, "peak_flops": PEAK_FLOPS * (2 if quant else 1)}  # FP8 dots
    if getattr(arch, "moe", None) is not None:  # a token reads only its experts' weights
        active = importlib.import_module(f"{package}.models.registry").param_counts(arch).active
        out["weight_bytes"] = float(weight_bytes * active / num_params)
        out["num_params"] = float(active)

    def run_alone(prompt: list[int], params: SamplingParams) -> list[float]:
        """Times (s, from submission) of each delta of one request run alone."""
        rid = engine.add_request(prompt, params)
        t0, times = time.perf_counter(), []
        while engine.has_unfinished:
            for d in engine.step():
                if d.request_id == rid:
                    times.append(time.perf_counter() - t0)
        return times

    # Warm-up: compile every kernel variant the parts below touch.
    run_alone(_prompt(rng, vocab, 4096), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    run_alone(_prompt(rng, vocab, 512), SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True))

    if "decode" in parts:
        times = run_alone(_prompt(rng, vocab, 1024), SamplingParams(temperature=0.0, max_tokens=512, ignore_eos=True))
        out["decode_tok_s"] = (len(times) - 1) / (times[-1] - times[0])
        out.update(_graph_ms(engine, 1, "step_1_graph_ms", profile))

    if "prefill" in parts:
        firsts = [run_alone(_prompt(rng, vocab, 4096), SamplingParams(temperature=0.0, max_tokens=1,
                                                                      ignore_eos=True))[0] for _ in range(3)]
        out["prefill_4k_ms_min"], out["prefill_4k_ms_med"] = min(firsts) * 1e3, statistics.median(firsts) * 1e3
        chunk = [run_alone(_prompt(rng, vocab, 512), SamplingParams(temperature=0.0, max_tokens=1,
                                                                    ignore_eos=True))[0] for _ in range(5)]
        out["chunk_512_ms"] = min(chunk) * 1e3

    # 256 sequences at ~1.5k context, decoding: only where the pool holds them all (an 80 GB
    # card holding Qwen3-30B-A3B's 61 GB of weights has room for ~100k tokens, not 400k:
    # the scheduler would keep a smaller batch running, and that batch's graph is not this one).
    blocks = engine.block_manager.num_blocks
    block_size = engine.block_manager.block_size
    out["kv_pool_blocks"] = float(blocks)
    if "step" in parts and (refusal := step_refusal(blocks, block_size)):
        print(f"hotpath: {refusal}", flush=True)
    elif "step" in parts:
        params = SamplingParams(temperature=1.0, max_tokens=400, ignore_eos=True)
        ids = [engine.add_request(_prompt(rng, vocab, 1536), params) for _ in range(STEP_SEQS)]
        sched = engine.scheduler
        while any(s.num_computed_tokens < s.num_tokens - 1 for s in sched.running) or sched.waiting:
            engine.step()
        # One call after the GPU went idle: an overlapped engine returns once the step is queued
        # (its host work alone), a synchronous one once it has run.
        calls = []
        for _ in range(30):
            _sync()
            t = time.perf_counter()
            engine.step()
            calls.append(time.perf_counter() - t)
        # Back to back, as a serving loop runs them (the step's sync on its tokens included).
        t = time.perf_counter()
        for _ in range(30):
            engine.step()
        _sync()
        out["step_256_wall_ms"] = (time.perf_counter() - t) / 30 * 1e3
        out["step_256_call_ms"] = statistics.median(calls) * 1e3
        out.update(_graph_ms(engine, STEP_SEQS, "step_256_graph_ms", profile))
        mixed = []
        for _ in range(5):
            engine.add_request(_prompt(rng, vocab, 512), SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
            _sync()
            t = time.perf_counter()
            engine.step()
            _sync()
            mixed.append(time.perf_counter() - t)
            engine.step()
        out["mixed_256_512_ms"] = min(mixed) * 1e3
        for rid in ids:
            engine.abort(rid)

    counts = [n for n in offline_requests if n > 0]
    if "offline" in parts and counts:
        running = offline_max_running(blocks, block_size, max_num_seqs)
        out["offline_max_running"] = float(running)
        engine.scheduler.config = dataclasses.replace(engine.scheduler.config, max_num_seqs=running)
        for n in counts:
            params = SamplingParams(temperature=1.0, max_tokens=1024, ignore_eos=True)
            out.update(_offline(engine, [_prompt(rng, vocab, 1024) for _ in range(n)], params))
            print(f"hotpath: offline {n} requests: {out[f'offline_{n}_tok_s']:,.1f} output tok/s, "
                  f"{out[f'offline_{n}_s']:.1f} s, at most {running} running", flush=True)
        out["offline_tok_s"] = out[f"offline_{counts[0]}_tok_s"]  # the first count's, as before
        out["offline_s"] = out[f"offline_{counts[0]}_s"]
        out["num_preemptions"] = float(engine.scheduler.num_preemptions)
    return out


def _offline(engine, prompts: list[list[int]], params) -> dict[str, float]:
    """Offline 1k/1k over `prompts`: output tokens/s and the wall time."""
    _sync()
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    _sync()
    wall = time.perf_counter() - t
    n = len(prompts)
    return {f"offline_{n}_tok_s": sum(len(o.token_ids) for o in outs) / wall, f"offline_{n}_s": wall}


def step_refusal(num_blocks: int, block_size: int) -> str | None:
    """Why the batch-256 and mixed figures cannot be taken on a pool of `num_blocks` (None: they
    can): the scheduler would keep a smaller batch running, whose graph is not the one timed."""
    need = STEP_SEQS * -(-STEP_TOKENS // block_size)
    if num_blocks >= need:
        return None
    return (f"the KV pool holds {num_blocks} blocks; {STEP_SEQS} sequences at ~1.5k context need {need}: the "
            f"batch-{STEP_SEQS} and mixed figures are refused")


def offline_max_running(num_blocks: int, block_size: int, max_num_seqs: int) -> int:
    """Offline 1k/1k at up to `max_num_seqs` running, as many as the pool holds to their end (no
    preemption): with FP8 weights and an FP8 cache an 80 GB card holds ~480 sequences of 2k."""
    return max(1, min(max_num_seqs, num_blocks // -(-2048 // block_size)))


def graph_refusal(layout: tuple[int, int, int] | None | tuple[()], bucket: int) -> str | None:
    """Why the decode graph of `bucket` cannot be replayed alone over the step inputs' `layout`
    ((bucket, width, q) of the last step's graph, None after an eager one, () in a tree from
    before layouts were kept: not known), None where it can: another graph's inputs (or an
    eager step's) lie where this one reads, and its token ids would be their slots (issue 53:
    a device-side assert past the vocabulary)."""
    if layout == () or (layout is not None and layout[0] == bucket and layout[2] == 1):
        return None
    return f"the last step left the inputs of {layout or 'an eager step'}, not of a decode graph of {bucket}"


def _graph_ms(engine, bucket: int, key: str, profile: bool) -> dict[str, float]:
    """The decode graph of `bucket` replayed alone (on the inputs of the last step, which must
    have been that graph's), on the GPU's clock; with `profile`, its kernels by total time too."""
    import torch

    graphs = engine.runner.graphs
    if graphs is None:
        return {}
    layout = getattr(engine.runner.inputs, "graph_layout", ())  # (bucket, width, q) the inputs hold
    if refusal := graph_refusal(layout, bucket):
        print(f"hotpath: {refusal}: {key} refused", flush=True)
        return {}
    if layout:
        graph = graphs._graphs[(bucket, 1, layout[1])].graph
    elif hasattr(graphs, "tiers"):  # a tree before graph_layout: the tier the last step used
        blocks = max((len(seq.block_ids) for seq in engine.scheduler.running), default=1024 // 16 + 1)
        width = next(w for w in graphs.tiers[bucket] if w >= blocks)
        # Keyed (bucket, tokens per sequence, width) since verification steps have graphs too.
        graph = graphs._graphs[(bucket, 1, width) if hasattr(graphs, "tokens_per_seq") else (bucket, width)].graph
    else:
        graph = graphs._graphs[bucket].graph
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(30):
        graph.replay()
    end.record()
    _sync()
    if profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                graph.replay()
            _sync()
        events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        events.sort(key=lambda e: -e.device_time_total)
        print(f"--- bucket {bucket}: kernels of one replay (us, count) ---")
        for e in events[:24]:
            print(f"{e.device_time_total / 10:9.1f} {e.count // 10:5d}  {e.key[:100]}")
        print(f"{sum(e.device_time_total for e in events) / 10:9.1f} {sum(e.count for e in events) // 10:5d}  total")
    return {key: start.elapsed_time(end) / 30}


def _run_tree(tree: Path, args: argparse.Namespace, kv_cache_dtype: str, quantization: str,
              parts: list[str]) -> dict[str, float]:
    moved = '"pdserve" = "."' in (tree / "pyproject.toml").read_text()
    with tempfile.NamedTemporaryFile(suffix=".json") as f, tempfile.TemporaryDirectory() as links:
        (Path(links) / "pdserve").symlink_to(tree, target_is_directory=True)
        env = dict(os.environ, PYTHONPATH=links if moved else str(tree), PYTHONUNBUFFERED="1")
        argv = [__file__, "--worker", f.name, "--package", "pdserve.engine" if moved else "engine",
                "--model", args.model, "--offline-requests", *map(str, args.offline_requests),
                "--kv-cache-dtypes", kv_cache_dtype, "--parts", *parts, "--max-num-seqs", str(args.max_num_seqs)]
        argv += ["--num-blocks", str(args.num_blocks)] if args.num_blocks else []
        argv += (["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
                 if args.gpu_memory_utilization is not None else [])
        argv += ["--quantizations", quantization] if quantization != "none" else []
        argv += ["--profile"] if args.profile else []
        # Run by path without its folder on sys.path (benchmarks/kernels.py would shadow `kernels`).
        code = f"import runpy, sys; sys.argv = {argv!r}; runpy.run_path(sys.argv[0], run_name='__main__')"
        if subprocess.run([sys.executable, "-c", code], cwd=tree, env=env).returncode:
            print(f"{tree}: failed (above); its column stays empty", flush=True)
            return {}
        return json.loads(Path(f.name).read_text())


ROWS = [  # key, label, better
    ("decode_tok_s", "single-stream decode, tok/s", "higher"),
    ("prefill_4k_ms_min", "one 4k prompt, first token, ms (best of 3)", "lower"),
    ("prefill_4k_ms_med", "one 4k prompt, first token, ms (median)", "lower"),
    ("step_1_graph_ms", "decode step 1 x 1k: graph replay (GPU), ms", "lower"),
    ("step_256_graph_ms", "decode step 256 x 1.5k: graph replay (GPU), ms", "lower"),
    ("step_256_wall_ms", "decode step 256 x 1.5k: wall, back to back, ms", "lower"),
    ("step_256_call_ms", "decode step 256 x 1.5k: one step() from idle, ms", "lower"),
    ("mixed_256_512_ms", "256 decodes + 512-token chunk, one step, ms", "lower"),
    ("chunk_512_ms", "512-token chunk alone, first token, ms", "lower"),
]


def _limits(r: dict[str, float]) -> dict[str, str]:
    w = r["weight_bytes"]
    return {
        "decode_tok_s": f"{r.get('copy_bw', COPY_BW['H200']) / w:.0f}",
        "prefill_4k_ms_min": f"{2 * r['num_params'] * 4096 / r.get('peak_flops', PEAK_FLOPS) * 1e3:.0f} (GEMMs only)",
        "mixed_256_512_ms": f"{r.get('step_256_wall_ms', 0) + r.get('chunk_512_ms', 0):.1f} (step + chunk)",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, help="another checkout to measure in the same run")
    parser.add_argument("--model", default="dummy:llama-3.1-8b")
    parser.add_argument("--offline-requests", type=int, nargs="+", default=[512],
                        help="offline 1k/1k request counts, each run in turn (0: none)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--profile", action="store_true", help="print the decode graphs' kernels (torch.profiler)")
    parser.add_argument("--kv-cache-dtypes", nargs="+", default=["auto"], choices=["auto", "fp8"],
                        help="KV cache dtypes to run this tree at (CacheConfig.kv_cache_dtype)")
    parser.add_argument("--quantizations", nargs="+", default=["none"], choices=["none", "fp8"],
                        help="weights to run this tree with (ModelConfig.quantization), each at every KV dtype")
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS, help="figures to measure")
    parser.add_argument("--baseline-parts", nargs="+", choices=PARTS, help="the baseline's figures (default: --parts)")
    parser.add_argument("--num-blocks", type=int, help="KV blocks (default: the memory left)")
    parser.add_argument("--max-num-seqs", type=int, default=512,
                        help="the scheduler's seats and largest decode graph; offline runs at most this many")
    parser.add_argument("--gpu-memory-utilization", type=float,
                        help="CacheConfig.gpu_memory_utilization, which sizes the pool (default: the engine's)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--package", default="pdserve.engine", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        Path(args.worker).write_text(json.dumps(measure(args.package, args.model, tuple(args.offline_requests),
                                                        args.profile, args.kv_cache_dtypes[0], args.quantizations[0],
                                                        tuple(args.parts), args.num_blocks, args.max_num_seqs,
                                                        args.gpu_memory_utilization)))
        return
    here = Path(__file__).resolve().parents[1]
    trees = [("baseline", args.baseline.resolve(), "auto", "none")] if args.baseline else []
    trees += [("this tree" + ("" if q == "none" else f", {q} weights") + ("" if kv == "auto" else f", {kv} KV"),
               here, kv, q) for q in args.quantizations for kv in args.kv_cache_dtypes]
    results = {}
    for name, tree, kv, q in trees:
        parts = args.baseline_parts if name == "baseline" and args.baseline_parts else args.parts
        results[name] = _run_tree(tree, args, kv, q, parts)
        print(json.dumps({name: results[name]}), flush=True)  # kept if a later tree does not finish
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    names = list(results)
    measured = [r for r in results.values() if r]
    if not measured:
        sys.exit("hotpath: every tree failed (above); no figures")
    limits = _limits(measured[-1])
    print(f"\n{args.model}, one GPU; limits from the weights a token reads, "
          f"{measured[-1]['weight_bytes'] / 1e9:.1f} GB")
    print("| figure | " + " | ".join(names) + (" | change" if len(names) >= 2 else "") + " | limit |")
    print("|---|" + "---:|" * (len(names) + (1 if len(names) >= 2 else 0)) + "---:|")
    rows = ROWS + [(f"offline_{n}_tok_s", f"offline 1k/1k, {n} requests, output tok/s", "higher")
                   for n in args.offline_requests if n]
    for key, label, _ in rows:
        vals = [results[n].get(key) for n in names]
        cells = [f"{v:,.1f}" if v is not None else "-" for v in vals]
        change = ""
        if len(names) >= 2:  # the last column over the first
            change = f" | {vals[-1] / vals[0]:.2f}x" if vals[0] and vals[-1] else " | -"
        print(f"| {label} | " + " | ".join(cells) + change + f" | {limits.get(key, '')} |")
    for n in names:
        if not results[n]:
            continue
        if "offline_s" not in results[n]:
            continue
        walls = ", ".join(f"{c} requests {results[n][f'offline_{c}_s']:.1f} s" for c in args.offline_requests
                          if f"offline_{c}_s" in results[n])
        print(f"{n}: offline {walls}, {results[n]['num_preemptions']:.0f} preemptions, "
              f"at most {results[n].get('offline_max_running', 256):.0f} running; "
              f"KV pool {results[n].get('kv_pool_blocks', 0):.0f} blocks")


if __name__ == "__main__":
    main()
