"""TFLOP/s of launch_paged (every key from the paged cache) vs the contiguous `launch`
(fresh prompts) and vs kernels.flash_prefill.flash_prefill (chunked prefill with context).

Run from the repository root (so `kernels` imports): python <this dir>/bench_paged.py
(imports _gluon_prefill_ws from its own directory: the persistent kernel with the paged mode)
"""

import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _gluon_prefill_ws as G  # noqa: E402

H, KVH, D = 32, 8, 128
DTYPE = torch.bfloat16
TOKENS = 16384


def _bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _paged(k, v, block_size):
    """Scatter [batch, seq_len, KVH, D] K/V over shuffled blocks of a paged cache."""
    b, s = k.shape[:2]
    nb = s // block_size
    perm = torch.randperm(b * nb, device=k.device)
    kc = torch.empty(b * nb, block_size, KVH, D, dtype=k.dtype, device=k.device)
    vc = torch.empty_like(kc)
    kc[perm] = k.reshape(b * nb, block_size, KVH, D)
    vc[perm] = v.reshape(b * nb, block_size, KVH, D)
    return kc, vc, perm.view(b, nb).to(torch.int32)


def _tflops(b, q, ctx, ms):
    return 4 * b * H * D * (q * ctx + q * q / 2) / ms / 1e9


def fresh(length, block_size):
    b = max(1, TOKENS // length)
    scale = D ** -0.5
    q = torch.randn(b * length, H, D, device="cuda", dtype=DTYPE)
    k = torch.randn(b, length, KVH, D, device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)
    kc, vc, bt = _paged(k, v, block_size)
    cu = torch.arange(0, b + 1, device="cuda", dtype=torch.int32) * length
    sl = torch.full((b,), length, device="cuda", dtype=torch.int32)
    kf, vf = k.reshape(b * length, KVH, D), v.reshape(b * length, KVH, D)
    out_c, out_p = torch.empty_like(q), torch.full_like(q, float("nan"))
    G.launch(q, kf, vf, cu, length, scale, out_c)
    G.launch_paged(q, kc, vc, cu, sl, bt, scale, length, out_p)
    err = _rel(out_p, out_c)
    ms_c = _bench(lambda: G.launch(q, kf, vf, cu, length, scale, out_c))
    ms_p = _bench(lambda: G.launch_paged(q, kc, vc, cu, sl, bt, scale, length, out_p))
    print(f"fresh {b:2d} x {length:5d}  bs {block_size:2d}: contiguous {_tflops(b, length, 0, ms_c):6.1f} TFLOP/s"
          f" ({ms_c:.3f} ms)  paged {_tflops(b, length, 0, ms_p):6.1f} TFLOP/s ({ms_p:.3f} ms)"
          f"  paged/contig {ms_c / ms_p:.3f}  rel err vs contiguous {err:.2e}")


def chunked(b, ctx, new, block_size):
    from kernels.flash_prefill import flash_prefill
    scale = D ** -0.5
    s = ctx + new
    q = torch.randn(b * new, H, D, device="cuda", dtype=DTYPE)
    k = torch.randn(b, s, KVH, D, device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)
    kc, vc, bt = _paged(k, v, block_size)
    cu = torch.arange(0, b + 1, device="cuda", dtype=torch.int32) * new
    sl = torch.full((b,), s, device="cuda", dtype=torch.int32)
    out_t, out_p = torch.empty_like(q), torch.full_like(q, float("nan"))
    flash_prefill(q, kc, vc, cu, sl, bt, scale, new, out_t)
    G.launch_paged(q, kc, vc, cu, sl, bt, scale, new, out_p)
    err = _rel(out_p, out_t)
    ms_t = _bench(lambda: flash_prefill(q, kc, vc, cu, sl, bt, scale, new, out_t))
    ms_p = _bench(lambda: G.launch_paged(q, kc, vc, cu, sl, bt, scale, new, out_p))
    print(f"chunked {b} x ({ctx} ctx + {new} new)  bs {block_size:2d}: flash_prefill {_tflops(b, new, ctx, ms_t):6.1f}"
          f" TFLOP/s ({ms_t:.3f} ms)  paged {_tflops(b, new, ctx, ms_p):6.1f} TFLOP/s ({ms_p:.3f} ms)"
          f"  speedup {ms_t / ms_p:.3f}  rel err vs flash_prefill {err:.2e}")


if __name__ == "__main__":
    if os.getcwd() not in sys.path:
        sys.path.insert(1, os.getcwd())
    if "/work/main" not in sys.path:
        sys.path.append("/work/main")
    torch.manual_seed(0)
    for length in (1024, 4096, 8192, 16384):
        fresh(length, 16)
    fresh(8192, 32)
    chunked(2, 4096, 4096, 16)
    chunked(2, 4096, 4096, 32)
