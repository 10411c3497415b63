"""The launches `compiled.py` compiles for Hopper: every Triton kernel of kernels/ whose tiles
depend on the dtype, at the tiles its launcher picks on a CUDA device, in each dtype it
takes. Each family yields (case, launch, estimate): launch calls the public launcher (its
kernels are recorded, not run; meta tensors where the real sizes matter), estimate is the
launcher's own shared-memory figure per kernel where it keeps one (fused MoE's), else None.

Run in a child process with Triton's interpreter off (`compiled.shared_memory_of`)."""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tests.kernels.compiled import HOPPER_SHARED

Case = tuple[str, Callable[[], Any], dict[str, int] | None]
UNFITTED = "unfitted E128 H2048 I768 k8 T=256 torch.float32"
F8 = torch.float8_e4m3fn
H100_SMS = 132


def fused_moe() -> Iterator[Case]:
    """Every plan `plan_for` picks: each row of the swept tables, and the rules' two at Mixtral's
    and Qwen2-MoE's shapes; in float32 and bf16 x and with FP8 experts, fitted to Hopper as
    `fused_moe` fits them on the card. And the 256-token Qwen3-30B-A3B plan in float32
    unfitted (what the H100 refused before the fit), to show the compiler's figure is the card's."""
    from pdserve.kernels import fused_moe as module
    from pdserve.kernels import moe_plan

    shapes = {f"E{e} H{h} I{i} k{k}": ((e, h, i, k), [min(most, 4096) for most, _ in table])
              for (e, h, i, k), table in moe_plan._TUNED.items()}
    shapes |= {"mixtral-8x7b": ((8, 4096, 14336, 2), [1, 512]), "qwen2-moe": ((60, 2048, 1408, 4), [1, 512])}
    for name, ((experts, hidden, inter, top_k), counts) in shapes.items():
        for num_tokens in counts:
            for dtype, scales in ((torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, "channel"),
                                  (torch.bfloat16, "block")):
                plan = moe_plan.fit_plan(moe_plan.plan_for(num_tokens, experts, hidden, inter, top_k),
                                         dtype.itemsize, HOPPER_SHARED)
                yield (f"{name} T={num_tokens} {dtype} {scales or ''}".strip(),
                       _moe_launch(module, num_tokens, experts, hidden, inter, top_k, dtype, scales, HOPPER_SHARED),
                       _moe_estimates(plan, dtype.itemsize))
    plan = moe_plan.plan_for(256, 128, 2048, 768, 8)
    yield (UNFITTED,
           _moe_launch(module, 256, 128, 2048, 768, 8, torch.float32, None, None, plan), _moe_estimates(plan, 4))


def _moe_estimates(plan: Any, element_size: int) -> dict[str, int]:
    from pdserve.kernels.moe_plan import _tile_bytes

    up, down = _tile_bytes(plan.gate_up, plan.grouped, 2, element_size), _tile_bytes(plan.down, plan.grouped, 1,
                                                                                      element_size)
    return {"_gate_up_silu_kernel": up, "_pair_gate_up_kernel": up, "_down_kernel": down, "_token_down_kernel": down}


def _moe_launch(module: types.ModuleType, num_tokens: int, experts: int, hidden: int, inter: int, top_k: int,
                dtype: torch.dtype, scales: str | None, limit: int | None, plan: Any = None) -> Callable[[], Any]:
    def launch() -> Any:
        meta = {"device": "meta"}
        weight_dtype = F8 if scales else dtype
        x = torch.empty(num_tokens, hidden, dtype=dtype, **meta)
        w13 = torch.empty(experts, 2 * inter, hidden, dtype=weight_dtype, **meta)
        w2 = torch.empty(experts, hidden, inter, dtype=weight_dtype, **meta)
        kw: dict[str, Any] = {}
        if scales == "channel":
            kw = {"w13_scale": torch.empty(experts, 2 * inter, 1, **meta), "w2_scale": torch.empty(experts, hidden, 1,
                                                                                                   **meta)}
        elif scales == "block":
            kw = {"w13_scale": torch.empty(experts, -(-2 * inter // 128), -(-hidden // 128), **meta),
                  "w2_scale": torch.empty(experts, -(-hidden // 128), inter // 128, **meta), "blocked": True}
        weights = torch.empty(num_tokens, top_k, **meta)
        ids = torch.empty(num_tokens, top_k, dtype=torch.int32, **meta)
        shared_memory_limit = module.shared_memory_limit
        module.shared_memory_limit = lambda device: limit  # a Hopper card's, or none (no fitting)
        try:
            return module.fused_moe(x, w13, w2, weights, ids, plan=plan, **kw)
        finally:
            module.shared_memory_limit = shared_memory_limit

    return launch


def _cuda_like(dtype: torch.dtype, shape: tuple[int, ...]) -> types.SimpleNamespace:
    """What a tiling function reads of a CUDA tensor (the launchers pick CPU tiles for a CPU one)."""
    return types.SimpleNamespace(is_cuda=True, shape=shape, dtype=dtype, element_size=lambda: dtype.itemsize,
                                 device=torch.device("cuda"))


def attention() -> Iterator[Case]:
    """flash_prefill, paged_decode and paged_verify at head dims 128 and 256, MLA decode and prefill
    at DeepSeek's widths; float32, bf16 and an FP8 cache; each default tiling branch."""
    yield from _flash_prefill()
    yield from _paged()
    yield from _mla()


def _flash_prefill() -> Iterator[Case]:
    from pdserve.kernels import flash_prefill as fp

    for dtype, cache in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, F8)):
        for head_dim in (128, 256):  # 64 needs less of everything
            for max_q, new_kv in ((1024, False), (8192, False), (1024, True), (4096, True)):
                tuning = fp._default_tuning(dtype, max_q, True, new_kv, head_dim)

                def launch(dtype=dtype, cache=cache, head_dim=head_dim, max_q=max_q, new_kv=new_kv, tuning=tuning):
                    q = torch.zeros(4, 8, head_dim, dtype=dtype)
                    k_cache = torch.zeros(4, 16, 2, head_dim).to(cache)
                    new = {"k_new": torch.zeros(4, 2, head_dim, dtype=dtype),
                           "v_new": torch.zeros(4, 2, head_dim, dtype=dtype)} if new_kv else {}
                    return fp.flash_prefill(q, k_cache, k_cache, torch.tensor([0, 4], dtype=torch.int32),
                                            torch.tensor([4], dtype=torch.int32), torch.zeros(1, 4, dtype=torch.int32),
                                            head_dim ** -0.5, max_q, **new, **tuning)

                yield f"flash_prefill {dtype} cache {cache} d={head_dim} q={max_q} new_kv={new_kv}", launch, None


def _paged() -> Iterator[Case]:
    from pdserve.kernels import paged_decode as pd

    pd._num_sms = lambda device: H100_SMS
    for dtype, cache in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, F8)):
        for head_dim in (128, 256):  # 64 needs less of everything
            for programs, splits in ((8, 4), (H100_SMS + 4, 1)):  # a small batch split, a mid batch whole
                block_n, stages = pd._default_tiling(_cuda_like(dtype, (1, 8, head_dim)), _cuda_like(cache, ()),
                                                     programs, splits, False)

                def launch(dtype=dtype, cache=cache, head_dim=head_dim, block_n=block_n, stages=stages):
                    q = torch.zeros(2, 8, head_dim, dtype=dtype)
                    k_cache = torch.zeros(4, 16, 2, head_dim).to(cache)
                    tables, lens = torch.zeros(2, 2, dtype=torch.int32), torch.tensor([3, 20], dtype=torch.int32)
                    pd.paged_decode(q, k_cache, k_cache, tables, lens, 0.1, num_splits=1, block_n=block_n,
                                    num_stages=stages)
                    return pd.paged_verify(q[:2], k_cache, k_cache, torch.tensor([0, 1, 2], dtype=torch.int32), lens,
                                           tables, 0.1, 1, block_n=block_n, num_stages=stages)

                yield f"paged {dtype} cache {cache} d={head_dim} tiles ({block_n}, {stages})", launch, None


def fp8_decode_pipelines() -> Iterator[Case]:
    """paged_decode over an FP8 cache at Llama-3.1-8B's heads (32 query, 8 KV, head dim 128, a
    bf16 query), one split, at the default before 5 stages (128 keys, 3) and the sweep's deeper
    pipelines; estimate: one K/V tile's bytes (K and V, a byte an element) and the stages."""
    from pdserve.kernels import paged_decode as pd

    for block_n, num_warps, num_stages in ((128, 4, 3), (128, 4, 5), (64, 4, 3), (64, 4, 6), (32, 4, 8)):
        def launch(block_n=block_n, num_warps=num_warps, num_stages=num_stages):
            q = torch.zeros(2, 32, 128, dtype=torch.bfloat16)
            k_cache = torch.zeros(4, 16, 8, 128).to(F8)
            tables, lens = torch.zeros(2, 2, dtype=torch.int32), torch.tensor([3, 20], dtype=torch.int32)
            return pd.paged_decode(q, k_cache, k_cache, tables, lens, 0.1, num_splits=1, block_n=block_n,
                                   num_warps=num_warps, num_stages=num_stages)

        yield (f"fp8 decode ({block_n}, {num_warps}, {num_stages})", launch,
               {"tile": 2 * block_n * 128, "stages": num_stages})


def _mla() -> Iterator[Case]:
    from pdserve.kernels import mla_decode as md
    from pdserve.kernels import mla_prefill as mp

    rank, rope, heads = 512, 64, 16
    for dtype, cache in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, F8)):
        for max_q in (1, 4):
            tuning = md.mla_decode_tiling(_cuda_like(dtype, ()), heads, max_q)

            def decode(dtype=dtype, cache=cache, max_q=max_q, tuning=tuning):
                q_nope, q_pe = torch.zeros(2 * max_q, heads, rank, dtype=dtype), torch.zeros(2 * max_q, heads, rope,
                                                                                             dtype=dtype)
                latent = torch.zeros(4, 16, rank + rope).to(cache)
                cu = torch.tensor([0, max_q, 2 * max_q], dtype=torch.int32) if max_q > 1 else None
                return md.mla_decode(q_nope, q_pe, latent, torch.zeros(2, 2, dtype=torch.int32),
                                     torch.tensor([5, 20], dtype=torch.int32), 0.1, cu, max_q, num_splits=1, **tuning)

            yield f"mla_decode {dtype} cache {cache} q={max_q}", decode, None
        if cache != F8:
            def prefill(dtype=dtype):
                t = lambda *shape: torch.zeros(*shape, dtype=dtype)  # noqa: E731
                cu = torch.tensor([0, 4], dtype=torch.int32)
                return mp.mla_prefill(t(4, heads, 128), t(4, heads, rope), t(4, heads, 128), t(4, 1, rope),
                                      t(4, heads, 128), cu, cu, 0.1, 4, **mp.mla_prefill_tuning(dtype, True))

            yield f"mla_prefill {dtype}", prefill, None


def gemm() -> Iterator[Case]:
    """gemv at its swept shapes and each rule's, fp8_gemm at 1 and 64 rows; float32, bf16 and
    FP8 weights."""
    from pdserve.kernels import fp8_gemm as fg
    from pdserve.kernels import gemv as gv

    shapes = list(gv._TUNED) + [(4096, 8192), (32768, 4096), (4096, 4096 + 128)]
    for n, k in shapes:
        for dtype, weight in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, F8)):
            def launch(n=n, k=k, dtype=dtype, weight=weight):
                meta = {"device": "meta"}
                scale = torch.empty(n, 1, **meta) if weight == F8 else None
                return gv.gemv(torch.empty(1, k, dtype=dtype, **meta), torch.empty(n, k, dtype=weight, **meta),
                               scale=scale)

            yield f"gemv {n}x{k} {dtype} weights {weight}", launch, None
    for m in (1, 64):
        for dtype in (torch.float32, torch.bfloat16):
            def fp8(m=m, dtype=dtype):
                meta = {"device": "meta"}
                return fg.fp8_gemm(torch.empty(m, 4096, dtype=dtype, **meta), torch.empty(4096, 4096, dtype=F8, **meta),
                                   torch.empty(4096, 1, **meta))

            yield f"fp8_gemm M={m} {dtype}", fp8, None


def fp8_w8a8() -> Iterator[Case]:
    """fp8_w8a8's table and sweep candidates at the 8B layer's widest and longest shapes
    (28672 x 4096, 4096 x 14336; the split-K partials' sum too), block-scaled for the table."""
    from pdserve.kernels import fp8_w8a8 as w8

    meta = {"device": "meta"}
    for upper, tiles in w8.CANDIDATES.items():
        for tile in tiles:
            for n, k in ((28672, 4096), (4096, 14336)):
                blocks = (False, True) if tile in dict(w8.TILES).values() and n == 4096 else (False,)
                for blocked in blocks:
                    scale = (torch.empty(n // 128, k // 128, **meta) if blocked else torch.empty(n, 1, **meta))

                    def launch(tile=tile, n=n, k=k, blocked=blocked, scale=scale, m=upper):
                        return w8.fp8_w8a8(torch.empty(m, k, dtype=F8, **meta), torch.empty(m, 1, **meta),
                                           torch.empty(n, k, dtype=F8, **meta), scale, blocked=blocked, tile=tile)

                    yield f"M={upper} {n}x{k}{' blocked' if blocked else ''} {tile.describe()}", launch, None


def routing() -> Iterator[Case]:
    """The routers' kernels at the real models' expert counts, float32 and bf16 logits:
    topk_route (Mixtral, Qwen2-MoE, Qwen3-30B-A3B) and grouped_topk_route (DeepSeek-V2's
    group_limited_greedy, V3's noaux_tc with its correction bias)."""
    from pdserve.kernels import moe_routing as mr

    meta = {"device": "meta"}
    for name, experts, top_k in (("mixtral", 8, 2), ("qwen2-moe", 60, 4), ("qwen3-30b-a3b", 128, 8)):
        for dtype in (torch.float32, torch.bfloat16):
            def flat(experts=experts, top_k=top_k, dtype=dtype):
                return mr.topk_route(torch.empty(256, experts, dtype=dtype, **meta), top_k, True)

            yield f"topk_route {name} {dtype}", flat, None
    for name, routing, experts, groups, topk_group, top_k in (("deepseek-v2", "group_limited_greedy", 160, 8, 3, 6),
                                                               ("deepseek-v3", "noaux_tc", 256, 8, 4, 8)):
        for dtype in (torch.float32, torch.bfloat16):
            def grouped(routing=routing, experts=experts, groups=groups, topk_group=topk_group, top_k=top_k,
                        dtype=dtype):
                bias = torch.empty(experts, **meta) if routing == "noaux_tc" else None
                return mr.grouped_topk_route(torch.empty(256, experts, dtype=dtype, **meta), routing, top_k, groups,
                                             topk_group, True, 2.5, bias)

            yield f"grouped_topk_route {name} {dtype}", grouped, None
