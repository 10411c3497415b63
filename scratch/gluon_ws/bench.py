"""Causal prefill TFLOP/s of flash_prefill_ws beside torch SDPA (flash, cuDNN) and the
engine's Triton flash_prefill (k_new/v_new path) in the same run, on one H100/H200.
Same shapes, data and timing as benchmarks/kernels.py's prefill case: Llama-3.1-8B
attention (32 q heads, 8 KV heads, head dim 128, bf16), 16k tokens per batch at
1k/4k/8k/16k per sequence, median of triton.testing.do_bench (L2 cleared each run).

    python <dir>/bench.py [--json PATH]      # from the repository root (imports `kernels`)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.getcwd())  # run from the repository root: `kernels` is the engine's package
from flash_prefill_ws import flash_prefill_ws

from kernels import flash_prefill

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
TOKENS = 16384
LENGTHS = [1024, 4096, 8192, 16384]


def _bench(fn: Callable[[], object]) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def prefill(length: int) -> list[dict]:
    batch = max(1, TOKENS // length)
    q = torch.randn(batch * length, NUM_Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch * length, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cu_seqlens = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * length
    scale = HEAD_DIM ** -0.5
    flops = 4 * batch * NUM_Q_HEADS * HEAD_DIM * length * length / 2  # causal: half the square
    group = NUM_Q_HEADS // NUM_KV_HEADS
    qs = q.view(batch, length, NUM_Q_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    ks = k.view(batch, length, NUM_KV_HEADS, HEAD_DIM).repeat_interleave(group, dim=2).transpose(1, 2).contiguous()
    vs = v.view(batch, length, NUM_KV_HEADS, HEAD_DIM).repeat_interleave(group, dim=2).transpose(1, 2).contiguous()
    # fp32 reference; for fp32 SDPA picks its memory-efficient kernel (no score matrix in memory).
    ref = F.scaled_dot_product_attention(qs.float(), ks.float(), vs.float(), is_causal=True)
    ref = ref.transpose(1, 2).reshape_as(q)
    rows = []

    def add(name: str, fn: Callable[[], torch.Tensor], out: torch.Tensor | None = None) -> None:
        try:
            if out is not None:
                out.fill_(float("nan"))
            res = fn()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 -- report and go on: one failing variant must not hide the rest
            print(f"{name} at {batch}x{length}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            return
        err = _rel_err(res, ref)
        ms = _bench(fn)
        rows.append({"case": f"{batch}x{length}", "impl": name, "ms": ms, "tflops": flops / ms / 1e9, "rel_err": err})
        print(f"{batch}x{length:<6} {name:28} {ms:9.4f} ms {flops / ms / 1e9:8.1f} TFLOP/s  err {err:.1e}", flush=True)

    for name, backend in (("sdpa flash", SDPBackend.FLASH_ATTENTION), ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION)):
        def sdpa(backend=backend) -> torch.Tensor:
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(1, 2).reshape_as(q)
        add(name, sdpa)
    out = torch.empty_like(q)
    # The engine's Triton kernel on its k_new/v_new path; an empty cache (context 0).
    k_cache = torch.empty(1, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.full((batch,), length, device="cuda", dtype=torch.int32)
    block_tables = torch.zeros(batch, 1, device="cuda", dtype=torch.int32)
    add("triton flash_prefill", lambda: flash_prefill(q, k_cache, k_cache, cu_seqlens, seq_lens, block_tables, scale,
                                                      length, out=out, k_new=k, v_new=v), out)
    for paired in (0, 1):
        add(f"gluon ws paired={paired}",
            lambda paired=paired: flash_prefill_ws(q, k, v, cu_seqlens, length, scale, out=out, paired=paired), out)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write every row here")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    rows = []
    for length in LENGTHS:
        rows += prefill(length)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
