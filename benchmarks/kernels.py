"""Kernel benchmarks on one GPU (Llama-3.1-8B attention: 32 query heads, 8 KV heads,
head dim 128, bf16, KV block 16), with baselines measured in the same run:

- prefill, causal, 1k/4k/8k/16k tokens per sequence (16k tokens per batch): TFLOP/s of
  flash_prefill_ws (what the engine runs for prompts without context on Hopper), its
  paged entry point and flash_prefill (elsewhere) beside torch SDPA's flash and cuDNN
  backends; flash_prefill reads the new tokens' K/V contiguously (k_new/v_new, as the
  engine calls it) and, for comparison, all of it through the paged cache; plus one
  chunked-prefill case (new tokens after context already in the cache: what
  flash_prefill_ws_paged serves on Hopper), ours only, checked against the paged-only
  Triton kernel;
- decode, batch {1, 8, 64, 256} x context {512, 4k, 32k}: bandwidth (K/V + q + out bytes
  over time) of paged_decode beside a device-to-device copy and torch SDPA on the same
  K/V laid out contiguously;
- verify (a speculative verification step: 5 new tokens after the context), 1 x 32k,
  8 x 4k, 64 x 4k: bandwidth of paged_verify beside flash_prefill and the Hopper kernel's
  paged entry point on the same cache;
- decode over an FP8 (e4m3) cache, 64 x 4k and 256 x 1.5k (`--only fp8kv`): bandwidth of its
  bytes (half a bf16 cache's), error against SDPA on the cache dequantized, the default tiling
  and (with --sweep) the others, or `--fp8kv-tilings`' (split counts too), each in the
  `--fp8kv-modes` (default both): tiles widened to bf16 ("fp8") and multiplied as e4m3 with
  the query and P rounded to e4m3 ("fp8-dot", paged_decode's opt-in fp8_dot);
- MLA decode at DeepSeek-V3's widths (`--only mla`: latent 512 + 64, 128 heads (one GPU's) and
  16 (TP 8's)), 64 x 4k and 256 x 1.5k over a bf16 and an FP8 latent cache: the latent bytes
  mla_decode reads over its time, beside the copy, error against torch's absorbed attention
  in float32; also the verification form (2 tokens a sequence: MTP's draft and the token
  before it) and (with --sweep) tilings at the default split count and at `--mla-splits`
  (rows marked *); `--mla-heads` and `--mla-caches` pick the head counts and cache dtypes.

    python -m benchmarks.kernels [--sweep] [--json PATH] [--only prefill|decode|fp8kv|mla]
                                 [--fp8kv-tilings "S,N,W,ST;..."] [--fp8kv-modes fp8 fp8-dot]
                                 [--mla-heads 128 16] [--mla-caches bf16 fp8] [--mla-tilings "H,N,W,S;..."]
                                 [--mla-splits 4 8] [--mla-cases 1x1024 64x4096]
                                 [--prefill-configs "M,N,W,S,A;..."]

(as a module: run as a script, this file's own name would shadow the kernels package).
--sweep also times tuning variants (tile shapes, warps, stages, split counts).
Prefill and copy times are medians of triton.testing.do_bench, which clears L2 before
every run; decode runs inside a CUDA graph (as the engine runs it) over rotating K/V
sets of 1 GiB in all, so no launch gaps and no L2 hits flatter or hurt it.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources
from triton.testing import do_bench

from pdserve.kernels import fp8
from pdserve.kernels.flash_prefill import flash_prefill
from pdserve.kernels.flash_prefill_ws import flash_prefill_ws, flash_prefill_ws_paged, flash_prefill_ws_supported
from pdserve.kernels.mla_decode import mla_decode, mla_decode_num_splits, mla_decode_tiling
from pdserve.kernels.paged_decode import decode_num_splits, paged_decode, paged_verify
from pdserve.kernels.split_merge import decode_workspace

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
PREFILL_TOKENS = 16384
PREFILL_LENS = [1024, 4096, 8192, 16384]
DECODE_BATCHES = [1, 8, 64, 256]
DECODE_CONTEXTS = [512, 4096, 32768]
PREFILL_SWEEP = [  # block_m, block_n, num_warps, num_stages, maxnreg (k_new/v_new path)
    (64, 64, 4, 3, 0), (128, 128, 8, 3, 0), (128, 64, 8, 2, 128), (128, 64, 8, 2, 0), (128, 32, 8, 3, 128),
]
PREFILL_KEYS = ("block_m", "block_n", "num_warps", "num_stages", "maxnreg")
PREFILL_CHUNKED = (2, 4096, 4096)  # batch, context already in the cache, new tokens
DECODE_SWEEP = [(32, 4, 3), (64, 4, 3), (128, 4, 2)]  # block_n, num_warps, num_stages
DECODE_SWEEP_CASES = [(1, 4096), (1, 32768), (8, 4096), (8, 32768)]
DECODE_ROTATE_BYTES = 1 << 30
FP8_DECODE_CASES = [(64, 4096), (256, 1536)]  # issue 42's figures
# block_n, num_warps, num_stages, each at the split counts around the default. Three stages or
# fewer leave one K/V buffer (the block-table load takes a stage): five and more, two or three
# (RESULTS.md, "FP8 KV decode: one tile in flight").
FP8_DECODE_SWEEP = [(64, 4, 3), (128, 4, 3), (128, 4, 2), (128, 8, 3), (256, 8, 2), (128, 4, 5), (128, 4, 8),
                    (64, 4, 6), (32, 4, 8)]
VERIFY_TOKENS = 5  # K = 4 drafted tokens + the last sampled one
MLA_RANK, MLA_ROPE = 512, 64  # DeepSeek-V3's latent
MLA_HEADS = [128, 16]  # V3's heads on one GPU (compute-bound at 242 FLOP a latent byte), and under TP 8 (30)
MLA_CASES = [(64, 4096), (256, 1536)]  # issue 52's figures
MLA_VERIFY_TOKENS = 2
# block_h, block_n, num_warps, num_stages, each at the default split count. (64, 32, 8, 2) was
# the default before 2026-12-06; (64, 64, 8, 2) is now (RESULTS.md, "DeepSeek under CUDA graphs").
MLA_SWEEP = [(16, 32, 4, 2), (32, 32, 4, 2), (32, 32, 8, 2), (64, 32, 8, 2), (64, 16, 8, 3), (64, 64, 8, 1),
             (64, 32, 8, 3), (64, 64, 8, 2)]
VERIFY_CASES = [(1, 32768), (8, 4096), (64, 4096)]  # batch, keys per sequence (new tokens included)


@dataclass(slots=True)
class Row:
    """One timed case: what ran, its median time, and the rate it reached."""

    kind: str
    case: str
    impl: str
    ms: float
    rate: float          # TFLOP/s (prefill) or TB/s (decode, copy)
    rel_err: float | None = None


def _bench(fn: Callable[[], object]) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def _runs(fn: Callable[[], object], config: object) -> bool:
    """Run once (compiling); a sweep config that exceeds shared memory or that the compiler
    rejects is reported and skipped."""
    try:
        fn()
    except (OutOfResources, CompilationError, RuntimeError) as e:
        print(f"skip {config}: {str(e)[:300]}")
        return False
    return True


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def _paged(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scatter contiguous [batch, len, kv_heads, dim] K/V over shuffled blocks of a paged cache."""
    batch, length = k.shape[:2]
    num_blocks = batch * length // BLOCK_SIZE
    perm = torch.randperm(num_blocks, device=k.device)
    k_cache = torch.empty(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=k.dtype, device=k.device)
    v_cache = torch.empty_like(k_cache)
    k_cache[perm] = k.reshape(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    v_cache[perm] = v.reshape(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return k_cache, v_cache, perm.view(batch, length // BLOCK_SIZE).to(torch.int32)


def ceilings() -> list[Row]:
    """Device-to-device copy (read + write bytes) and a bf16 8192^3 matmul."""
    src = torch.randn(1 << 29, device="cuda", dtype=DTYPE)  # 1 GiB
    dst = torch.empty_like(src)
    ms = _bench(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    mm_ms = _bench(lambda: a @ a)
    return [Row("ceiling", "copy 1 GiB", "torch copy_", ms, 2 * src.nbytes / ms / 1e9),
            Row("ceiling", "matmul 8192^3", "torch bf16", mm_ms, 2 * 8192**3 / mm_ms / 1e9)]


def prefill(length: int, configs: list[tuple[int, ...]]) -> list[Row]:
    batch = max(1, PREFILL_TOKENS // length)
    q = torch.randn(batch * length, NUM_Q_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    k = torch.randn(batch, length, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)
    k_cache, v_cache, block_tables = _paged(k, v)
    k_new, v_new = k.flatten(0, 1), v.flatten(0, 1)  # the step's own K/V, packed like q
    cu_seqlens = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * length
    seq_lens = torch.full((batch,), length, device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)
    scale = HEAD_DIM ** -0.5
    flops = 4 * batch * NUM_Q_HEADS * HEAD_DIM * length * length / 2  # causal: half the square
    case = f"{batch}x{length}"
    group = NUM_Q_HEADS // NUM_KV_HEADS
    qs = q.view(batch, length, NUM_Q_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    ks = k.repeat_interleave(group, dim=2).transpose(1, 2).contiguous()
    vs = v.repeat_interleave(group, dim=2).transpose(1, 2).contiguous()
    rows = []
    ref = None
    for name, backend in (("sdpa flash", SDPBackend.FLASH_ATTENTION), ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                fn = lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)  # noqa: E731
                res = fn()
                ms = _bench(fn)
        except RuntimeError as e:  # a backend unavailable here is reported, not fatal
            print(f"{name} at {case}: {str(e)[:120]}")
            continue
        ref = res.transpose(1, 2).reshape_as(q) if ref is None else ref
        rows.append(Row("prefill", case, name, ms, flops / ms / 1e9))
    if flash_prefill_ws_supported(q.device, q.dtype, HEAD_DIM, BLOCK_SIZE):
        # The engine's kernel for fresh prompts, and its paged entry point on the same input.
        rows += _time("prefill", case, [
            ("ours ws (Hopper, no context)",
             lambda: flash_prefill_ws(q, k_new, v_new, cu_seqlens, length, scale, out=out)),
            ("ours ws paged (Hopper)",
             lambda: flash_prefill_ws_paged(q, k_cache, v_cache, cu_seqlens, seq_lens, block_tables, scale, length,
                                            out=out)),
        ], out, ref, lambda ms: flops / ms / 1e9)
    # (name, k_new/v_new given, tuning): defaults first, then the sweep on the engine's path.
    variants = [("ours default", True, {}), ("ours paged-only default", False, {})]
    variants += [(f"ours {c}", True, dict(zip(PREFILL_KEYS, c))) for c in configs]
    for name, new_kv, cfg in variants:
        extra = {"k_new": k_new, "v_new": v_new} if new_kv else {}
        fn = lambda: flash_prefill(q, k_cache, v_cache, cu_seqlens, seq_lens, block_tables, scale, length,  # noqa: E731
                                   out=out, **extra, **cfg)
        out.fill_(float("nan"))
        if not _runs(fn, cfg):
            continue
        err = _rel_err(out, ref) if ref is not None else None
        ms = _bench(fn)
        rows.append(Row("prefill", case, name, ms, flops / ms / 1e9, err))
    return rows


@dataclass(frozen=True)
class _Chunks:
    """q_len new tokens for each of `batch` sequences after `context` cached positions, the
    arguments flash_prefill / flash_prefill_ws_paged / paged_verify share, and the
    paged-only flash_prefill's output as the reference."""

    args: tuple
    k_new: torch.Tensor
    v_new: torch.Tensor
    kv_bytes: int
    ref: torch.Tensor


def _chunks(batch: int, context: int, q_len: int) -> _Chunks:
    seq_len = context + q_len
    q = torch.randn(batch * q_len, NUM_Q_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    k = torch.randn(batch, seq_len, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)
    k_cache, v_cache, block_tables = _paged(k, v)
    cu_seqlens = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * q_len
    seq_lens = torch.full((batch,), seq_len, device="cuda", dtype=torch.int32)
    args = (q, k_cache, v_cache, cu_seqlens, seq_lens, block_tables, HEAD_DIM ** -0.5, q_len)
    return _Chunks(args, k[:, context:].flatten(0, 1), v[:, context:].flatten(0, 1), k.nbytes + v.nbytes,
                   flash_prefill(*args))


def _time(kind: str, case: str, variants: list[tuple[str, Callable[[], object]]], out: torch.Tensor,
          ref: torch.Tensor | None, rate: Callable[[float], float]) -> list[Row]:
    """Each variant once into a NaN-poisoned out (checked against ref, if any), then timed."""
    rows = []
    for name, fn in variants:
        out.fill_(float("nan"))
        fn()
        err = _rel_err(out, ref) if ref is not None else None
        ms = _bench(fn)
        rows.append(Row(kind, case, name, ms, rate(ms), err))
    return rows


def prefill_chunked(batch: int, context: int, q_len: int) -> list[Row]:
    """New tokens after `context` positions already in the cache: the k_new path reads the
    context through the block table and the new tokens contiguously."""
    c = _chunks(batch, context, q_len)
    out = torch.empty_like(c.args[0])
    variants = [("ours default", lambda: flash_prefill(*c.args, out=out, k_new=c.k_new, v_new=c.v_new)),
                ("ours paged-only default", lambda: flash_prefill(*c.args, out=out))]
    if flash_prefill_ws_supported(out.device, out.dtype, HEAD_DIM, BLOCK_SIZE):  # the engine's kernel on Hopper
        variants.append(("ours ws paged (Hopper)", lambda: flash_prefill_ws_paged(*c.args, out=out)))
    flops = 4 * batch * NUM_Q_HEADS * HEAD_DIM * (q_len * context + q_len * q_len / 2)
    return _time("prefill", f"{batch}x({context}+{q_len})", variants, out, c.ref, lambda ms: flops / ms / 1e9)


def verify(batch: int, context: int, q_len: int) -> list[Row]:
    """A speculative verification step's attention: q_len new tokens per sequence after
    `context` cached ones. Memory-bound like decode: rate is K/V (+ q, out) bytes over time."""
    c = _chunks(batch, context, q_len)
    out = torch.empty_like(c.args[0])
    variants = [("flash_prefill (k_new)", lambda: flash_prefill(*c.args, out=out, k_new=c.k_new, v_new=c.v_new))]
    if flash_prefill_ws_supported(out.device, out.dtype, HEAD_DIM, BLOCK_SIZE):
        variants.append(("ours ws paged (Hopper)", lambda: flash_prefill_ws_paged(*c.args, out=out)))
    variants.append(("ours paged_verify", lambda: paged_verify(*c.args, out=out)))
    nbytes = c.kv_bytes + 2 * out.nbytes
    return _time("verify", f"{batch}x({context}+{q_len})", variants, out, c.ref, lambda ms: nbytes / ms / 1e9)


def _bench_graph(fns: list[Callable[[], object]], replays: int = 20) -> float:
    """Median ms per call of `fns` captured back to back in one CUDA graph, as the engine's
    decode step runs them: no Python launch gaps between kernels."""
    for fn in fns:
        fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2] / len(fns)


def decode(batch: int, context: int, sweep: bool) -> list[Row]:
    # Small caches fit in L2 (50 MB): rotate over enough independent sets (like the layers
    # of one decode step) that every call reads from HBM.
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize
    num_sets = -(-DECODE_ROTATE_BYTES // kv_bytes)
    sets = []
    for _ in range(num_sets):
        q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
        k = torch.randn(batch, context, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
        v = torch.randn_like(k)
        sets.append((q, k, v, *_paged(k, v)))
    seq_lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    out = torch.empty_like(sets[0][0])
    scale = HEAD_DIM ** -0.5
    nbytes = kv_bytes + 2 * out.nbytes
    case = f"{batch}x{context}"
    group = NUM_Q_HEADS // NUM_KV_HEADS

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # Contiguous K/V; the query heads of a KV group become that group's query rows.
        qs = q.view(batch, NUM_KV_HEADS, group, HEAD_DIM)
        return F.scaled_dot_product_attention(qs, k.transpose(1, 2), v.transpose(1, 2), scale=scale)

    ref = sdpa(*sets[0][:3]).reshape_as(out)
    ms = _bench_graph([lambda s=s: sdpa(*s[:3]) for s in sets])
    rows = [Row("decode", case, "sdpa contiguous", ms, nbytes / ms / 1e9)]
    default_splits = decode_num_splits(batch, NUM_KV_HEADS, HEAD_DIM, context, out.device)
    configs = [(None, 64, 4, 3)]
    if sweep and (batch, context) in DECODE_SWEEP_CASES:
        splits = sorted({max(1, default_splits // 2), default_splits, default_splits * 2})
        configs += [(s, *c) for s in splits for c in DECODE_SWEEP]
    for splits, block_n, num_warps, num_stages in configs:
        num_splits = splits or default_splits
        ws = decode_workspace(batch, NUM_Q_HEADS, HEAD_DIM, num_splits, out.device)
        fns = [lambda s=s: paged_decode(s[0], s[3], s[4], s[5], seq_lens, scale, out=out, workspace=ws,
                                        block_n=block_n, num_warps=num_warps, num_stages=num_stages)
               for s in sets]
        out.fill_(float("nan"))
        if not _runs(fns[0], (num_splits, block_n, num_warps, num_stages)):
            continue
        err = _rel_err(out, ref)
        ms = _bench_graph(fns)
        name = "ours default" if splits is None else "ours"
        rows.append(Row("decode", case, f"{name} (S{num_splits},{block_n},{num_warps},{num_stages})",
                        ms, nbytes / ms / 1e9, err))
    return rows


def decode_fp8(batch: int, context: int, sweep: bool, tilings: list[tuple[int, int, int, int]] | None = None,
               modes: tuple[str, ...] = ("fp8", "fp8-dot")) -> list[Row]:
    """paged_decode over an e4m3 cache, widening its tiles ("fp8") and (fp8_dot) not: the rate
    counts the FP8 bytes it reads. tilings: (splits, block_n, num_warps, num_stages), splits 0
    the default count, timed after the default instead of the sweep's."""
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM  # one byte an element
    num_sets = -(-DECODE_ROTATE_BYTES // kv_bytes)
    sets, refs = [], []
    for i in range(num_sets):
        q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
        k = fp8.quantize(torch.randn(batch, context, NUM_KV_HEADS, HEAD_DIM, device="cuda"))
        v = fp8.quantize(torch.randn(batch, context, NUM_KV_HEADS, HEAD_DIM, device="cuda"))
        if i == 0:
            refs = [q, k.to(DTYPE), v.to(DTYPE)]
        sets.append((q, *_paged(k, v)))
    seq_lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    out = torch.empty_like(sets[0][0])
    scale = HEAD_DIM ** -0.5
    nbytes = kv_bytes + 2 * out.nbytes
    group = NUM_Q_HEADS // NUM_KV_HEADS
    q, k, v = refs
    ref = F.scaled_dot_product_attention(q.view(batch, NUM_KV_HEADS, group, HEAD_DIM), k.transpose(1, 2),
                                         v.transpose(1, 2), scale=scale).reshape_as(out)
    default_splits = decode_num_splits(batch, NUM_KV_HEADS, HEAD_DIM, context, out.device)
    configs = [(default_splits, None, None, None)]
    if tilings:
        configs += [(n or default_splits, *c) for n, *c in tilings]
    elif sweep:
        configs += [(n, *c) for n in sorted({max(1, default_splits // 2), default_splits, default_splits * 2})
                    for c in FP8_DECODE_SWEEP]
    rows = []
    for (splits, block_n, num_warps, num_stages), mode in itertools.product(configs, modes):
        fp8_dot = mode == "fp8-dot"
        tiling = {} if block_n is None else {"block_n": block_n, "num_warps": num_warps, "num_stages": num_stages}
        ws = decode_workspace(batch, NUM_Q_HEADS, HEAD_DIM, splits, out.device)
        fns = [lambda s=s, dot=fp8_dot: paged_decode(s[0], s[1], s[2], s[3], seq_lens, scale, out=out, workspace=ws,
                                                     fp8_dot=dot, **tiling)
               for s in sets]
        out.fill_(float("nan"))
        if not _runs(fns[0], tiling):
            continue
        err = _rel_err(out, ref)
        ms = _bench_graph(fns)
        name = f"{mode} default" if block_n is None else f"{mode} (S{splits},{block_n},{num_warps},{num_stages})"
        rows.append(Row("decode", f"{batch}x{context}", f"ours {name}", ms, nbytes / ms / 1e9, err))
    return rows


def _mla_sets(batch: int, context: int, heads: int, cache_dtype: torch.dtype) -> list[tuple[torch.Tensor, ...]]:
    """Enough independent (q_nope, q_pe, latent cache, block table) sets, 1 GiB of latents in
    all, that each call reads from HBM; the cache's blocks shuffled as a pool's are."""
    latent_bytes = batch * context * (MLA_RANK + MLA_ROPE) * cache_dtype.itemsize
    sets = []
    for _ in range(-(-DECODE_ROTATE_BYTES // latent_bytes)):
        # A normalised c_kv and a query of DeepSeek's scale: scores of a few units, not a one-hot softmax.
        latent = torch.randn(batch * context // BLOCK_SIZE, BLOCK_SIZE, MLA_RANK + MLA_ROPE, device="cuda")
        cache = fp8.quantize(latent) if cache_dtype == fp8.KV_FP8 else latent.to(cache_dtype)
        perm = torch.randperm(cache.shape[0], device="cuda")
        cache = cache[perm].contiguous()  # logical block j of sequence b sits at perm_inverse
        block_tables = torch.argsort(perm).view(batch, context // BLOCK_SIZE).to(torch.int32)
        q = torch.randn(batch, heads, MLA_RANK + MLA_ROPE, device="cuda", dtype=DTYPE) * 0.3
        sets.append((q[..., :MLA_RANK], q[..., MLA_RANK:], cache, block_tables))
    return sets


def _mla_reference(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                   q_lens: int, scale: float) -> torch.Tensor:
    """Absorbed MLA attention in float32 over the latents gathered contiguous; q_lens tokens
    a sequence (packed), causal among them."""
    batch = block_tables.shape[0]
    latent = cache.float()[block_tables.long()].view(batch, -1, MLA_RANK + MLA_ROPE)       # [B, L, 576]
    heads = q_nope.shape[1]
    q = torch.cat([q_nope, q_pe], -1).float().view(batch, q_lens, heads, -1)
    scores = torch.einsum("bthd,bkd->bhtk", q, latent) * scale
    length = latent.shape[1]
    q_pos = torch.arange(length - q_lens, length, device=q.device)[:, None]
    scores = scores.masked_fill(torch.arange(length, device=q.device)[None, :] > q_pos, float("-inf"))
    out = torch.einsum("bhtk,bkc->bthc", scores.softmax(-1), latent[..., :MLA_RANK])
    return out.reshape(batch * q_lens, heads, MLA_RANK)


def mla(batch: int, context: int, heads: int, cache_dtype: torch.dtype,
        tilings: list[tuple[int, ...]], splits: list[int] | None = None) -> list[Row]:
    """mla_decode (and its verification form) at V3's widths: the rate counts the latent bytes
    read (576 values a token, 2 bytes or 1), the query's and the output's. Each tiling runs at
    the default split count and at each of `splits`."""
    sets = _mla_sets(batch, context, heads, cache_dtype)
    seq_lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    scale = (128 + MLA_ROPE) ** -0.5  # V3's qk_head_dim, before YaRN's mscale
    latent_bytes = batch * context * (MLA_RANK + MLA_ROPE) * cache_dtype.itemsize
    mode = "fp8" if cache_dtype == fp8.KV_FP8 else "bf16"
    rows = []
    for q_lens in (1, MLA_VERIFY_TOKENS):
        # The verification form: q_lens tokens a sequence, the last q_lens positions of its context.
        sets_q = [(q_nope.repeat_interleave(q_lens, 0), q_pe.repeat_interleave(q_lens, 0), *rest)
                  for q_nope, q_pe, *rest in sets]
        verify = {} if q_lens == 1 else {
            "cu_seqlens_q": torch.arange(0, batch * q_lens + 1, q_lens, device="cuda", dtype=torch.int32),
            "max_seqlen_q": q_lens}
        out = torch.empty_like(sets_q[0][0])
        ref = _mla_reference(*sets_q[0], q_lens, scale)
        nbytes = latent_bytes + 2 * out.nbytes + sets_q[0][1].nbytes
        default = mla_decode_tiling(out, heads, q_lens)
        default_splits = mla_decode_num_splits(batch, heads, default["block_h"], context, out.device, q_lens)
        configs = [(default_splits, None)]
        if q_lens == 1:
            configs += [(n, c) for c in tilings for n in dict.fromkeys([default_splits, *(splits or [])])]
        for num_splits, tiling in configs:
            kw = {} if tiling is None else dict(zip(("block_h", "block_n", "num_warps", "num_stages"), tiling))
            ws = decode_workspace(batch * q_lens, heads, MLA_RANK, num_splits, out.device)
            fns = [lambda s=s, kw=kw, ws=ws: mla_decode(*s, seq_lens, scale, out=out, workspace=ws, **verify, **kw)
                   for s in sets_q]
            out.fill_(float("nan"))
            if not _runs(fns[0], (num_splits, tiling)):
                continue
            err = _rel_err(out, ref)
            ms = _bench_graph(fns)
            form = "mla" if q_lens == 1 else f"mla verify {q_lens}"
            name = "default" if tiling is None else "(" + ",".join(map(str, tiling)) + ")"
            name += "" if num_splits == default_splits else "*"  # not the launcher's split count
            rows.append(Row("mla", f"{batch}x{context}", f"ours {form} {heads}h {mode} S{num_splits} {name}",
                            ms, nbytes / ms / 1e9, err))
    return rows


def _print(rows: list[Row], copy_tbs: float) -> None:
    for r in rows:
        pct = f"{100 * r.rate / copy_tbs:6.1f}%" if r.kind in ("decode", "verify", "mla") else ""
        err = f"{r.rel_err:.1e}" if r.rel_err is not None else ""
        print(f"{r.kind:8} {r.case:10} {r.impl:34} {r.ms:9.4f} {r.rate:8.2f} {pct:>7} {err:>8}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="also time tuning variants")
    parser.add_argument("--json", help="write every row here")
    parser.add_argument("--only", choices=["prefill", "decode", "fp8kv", "mla"], help="run one part")
    parser.add_argument("--mla-heads", type=int, nargs="+", default=MLA_HEADS, help="--only mla: head counts")
    parser.add_argument("--mla-caches", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"],
                        help="--only mla: latent cache dtypes")
    parser.add_argument("--mla-tilings", help="MLA sweep instead of the built-in one: "
                        "'block_h,block_n,num_warps,num_stages;...' (implies --sweep)")
    parser.add_argument("--mla-cases", nargs="+", help="--only mla: 'BATCHxCONTEXT' cases (default 64x4096 256x1536)")
    parser.add_argument("--mla-splits", type=int, nargs="+", help="--only mla: split counts the tilings also run at")
    parser.add_argument("--fp8kv-tilings", help="--only fp8kv: tilings instead of the sweep's: "
                        "'splits,block_n,num_warps,num_stages;...' (splits 0: the default count)")
    parser.add_argument("--fp8kv-modes", nargs="+", default=["fp8", "fp8-dot"], choices=["fp8", "fp8-dot"],
                        help="--only fp8kv: widening the tiles (fp8), multiplying them as e4m3 (fp8-dot)")
    parser.add_argument("--prefill-configs", help="prefill sweep instead of the built-in one: "
                        "'block_m,block_n,num_warps,num_stages,maxnreg;...' (implies --sweep)")
    args = parser.parse_args()
    if args.prefill_configs:
        prefill_configs = [tuple(int(x) for x in c.split(",")) for c in args.prefill_configs.split(";")]
    else:
        prefill_configs = PREFILL_SWEEP if args.sweep else []
    fp8_tilings = ([tuple(int(x) for x in c.split(",")) for c in args.fp8kv_tilings.split(";")]
                   if args.fp8kv_tilings else None)
    if fp8_tilings and any(len(t) != 4 for t in fp8_tilings):
        parser.error(f"--fp8kv-tilings: 'splits,block_n,num_warps,num_stages' each, got {args.fp8kv_tilings!r}")
    rows = ceilings()
    copy_tbs = rows[0].rate
    header = f"{'kind':8} {'case':10} {'impl':34} {'ms':>9} {'rate':>8} {'% copy':>7} {'rel_err':>8}"
    print(f"{torch.cuda.get_device_name()}  copy {copy_tbs:.2f} TB/s  matmul {rows[1].rate:.0f} TFLOP/s")
    print(header)
    cases = []
    if args.only not in ("decode", "fp8kv", "mla"):
        cases += [lambda n=n: prefill(n, prefill_configs) for n in PREFILL_LENS]
        cases.append(lambda: prefill_chunked(*PREFILL_CHUNKED))
    if args.only == "fp8kv":
        cases += [lambda b=b, c=c: decode_fp8(b, c, args.sweep, fp8_tilings, tuple(args.fp8kv_modes))
                  for b, c in FP8_DECODE_CASES]
    elif args.only == "mla":
        caches = [{"bf16": DTYPE, "fp8": fp8.KV_FP8}[c] for c in args.mla_caches]
        mla_cases = ([tuple(int(x) for x in c.split("x")) for c in args.mla_cases] if args.mla_cases
                     else MLA_CASES)
        tilings = ([tuple(int(x) for x in c.split(",")) for c in args.mla_tilings.split(";")] if args.mla_tilings
                   else MLA_SWEEP if args.sweep else [])
        cases += [lambda b=b, c=c, h=h, d=d: mla(b, c, h, d, tilings, args.mla_splits)
                  for h in args.mla_heads for b, c in mla_cases for d in caches]
    elif args.only != "prefill":
        cases += [lambda b=b, c=c: decode(b, c, args.sweep) for b in DECODE_BATCHES for c in DECODE_CONTEXTS]
        cases += [lambda b=b, c=c: verify(b, c - VERIFY_TOKENS, VERIFY_TOKENS) for b, c in VERIFY_CASES]
    for run_case in cases:  # rows print as they come, so a run cut short still reports
        new = run_case()
        _print(new, copy_tbs)
        rows += new
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": [asdict(r) for r in rows]}, f, indent=1)
    # The summary: our default version beside the baselines.
    print(f"\nsummary (rate: TFLOP/s for prefill, TB/s for decode and verify; copy {copy_tbs:.2f} TB/s)")
    print(header)
    _print([r for r in rows[2:] if not r.impl.startswith("ours") or "default" in r.impl or "ws" in r.impl
            or "verify" in r.impl], copy_tbs)


if __name__ == "__main__":
    main()
