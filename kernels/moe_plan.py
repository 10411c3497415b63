"""How a fused_moe call runs (`kernels/fused_moe.py`): the path (per pair, or grouped GEMMs over
pairs grouped by expert) and its two kernels' tiles. `plan_for` picks them from a table swept
on the H200 (`benchmarks/moe_sweep.py`, results in benchmarks/RESULTS.md) for the shapes it
timed, rules elsewhere; `fit_plan` shrinks the tiles to the device's shared memory at x's
dtype (the table is for 2-byte x). Host code only: no kernel here."""

from __future__ import annotations

import dataclasses
import functools

import torch


@dataclasses.dataclass(frozen=True)
class Tile:
    """One kernel's launch: BLOCK_N output columns (and BLOCK_M pairs on the grouped path)
    per program, BLOCK_K of the reduction per iteration."""

    block_n: int
    block_k: int
    num_warps: int = 4
    block_m: int = 16
    num_stages: int = 3


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one fused_moe call runs: per pair and token (`grouped=False`, few pairs) or as
    grouped GEMMs over pairs grouped by expert; the tiles of its two kernels."""

    grouped: bool
    gate_up: Tile
    down: Tile

    def __post_init__(self) -> None:
        for name, tile in (("gate_up", self.gate_up), ("down", self.down)):
            blocks = {"block_n": tile.block_n, "block_k": tile.block_k}
            if self.grouped:
                blocks["block_m"] = tile.block_m
            for block, size in blocks.items():
                low = 16 if self.grouped else 1
                if size < low or size & (size - 1):
                    raise ValueError(f"fused_moe: {name}.{block} must be a power of two >= {low}, got {size}")


PAIRS = Plan(False, Tile(8, 256), Tile(8, 256))
GROUPED = Plan(True, Tile(64, 64), Tile(64, 64))

# (experts, hidden, intermediate, top_k) -> ((most tokens, plan), ...), ascending: the plan of
# the first entry whose bound is >= the call's tokens, else the last. Swept on the H200
# (benchmarks/moe_sweep.py; benchmarks/RESULTS.md, "Fused MoE on the H200").
_TUNED: dict[tuple[int, int, int, int], tuple[tuple[int, Plan], ...]] = {
    (128, 2048, 768, 8): (  # Qwen3-30B-A3B
        (1, Plan(False, Tile(8, 128, 8), Tile(4, 512, 4))),
        (2, Plan(False, Tile(16, 512, 4), Tile(4, 512, 4))),
        (4, Plan(False, Tile(8, 128, 8), Tile(4, 256, 4))),
        (16, Plan(False, Tile(8, 128, 8), Tile(16, 128, 8))),
        (256, Plan(True, Tile(128, 128, 4, 16, 4), Tile(128, 128, 4, 16, 3))),
        (512, Plan(True, Tile(128, 64, 4, 16, 3), Tile(128, 64, 4, 16, 3))),
        (2048, Plan(True, Tile(64, 64, 4, 64, 3), Tile(128, 64, 8, 64, 3))),
    ),
    # DeepSeek-V2-Lite, one token (swept on an H100, 2026-12-06: 77 -> 49 us); above it the
    # rules' plans (PAIRS up to 64 pairs, GROUPED beyond), not yet swept.
    (64, 2048, 1408, 6): (
        (1, Plan(False, Tile(16, 256, 4), Tile(2, 512, 4))),
        (10, PAIRS),
        (1 << 31, GROUPED),
    ),
}


def plan_for(num_tokens: int, num_experts: int, hidden: int, inter: int, top_k: int) -> Plan:
    """The sweep's plan for a shape it timed, else per pair up to 64 pairs and grouped above."""
    table = _TUNED.get((num_experts, hidden, inter, top_k))
    if table:
        return next((plan for most, plan in table if num_tokens <= most), table[-1][1])
    return PAIRS if num_tokens * top_k <= 64 else GROUPED


def _tile_bytes(tile: Tile, grouped: bool, weight_tiles: int, element_size: int) -> int:
    """The shared memory one kernel's launch needs (see `shared_memory_bytes`)."""
    rows = tile.block_m if grouped else 1
    # Hopper's warpgroup MMA (16-bit tiles of 64+ rows) reads every stage from shared memory;
    # mma.sync's pipeline keeps one stage fewer there (float32 at "ieee" always takes it).
    copies = tile.num_stages if grouped and rows >= 64 and element_size <= 2 else tile.num_stages - 1
    loop = max(copies, 1) * (rows + weight_tiles * tile.block_n) * tile.block_k * element_size
    return max(loop, rows * tile.block_n * 4)


def shared_memory_bytes(plan: Plan, element_size: int) -> int:
    """The shared memory the larger of the plan's two kernels needs, x and the weights both
    of `element_size` bytes (FP8 weights take less: an upper bound for them). Triton's
    software pipeline keeps num_stages - 1 copies of each tile a loop iteration loads (x's
    BLOCK_M x BLOCK_K, a row of it per pair on the per-pair path, and BLOCK_K x BLOCK_N of
    each weight: gate and up, or down), num_stages where Hopper's warpgroup MMA reads them
    (16-bit, BLOCK_M >= 64); the output's BLOCK_M x BLOCK_N float32 passes through it after
    the loop. (On an H100 the grouped gate/up kernel at BLOCK_M 16, BLOCK_N 128, BLOCK_K 128,
    4 stages, float32 asked Triton for 417,792 bytes: this count. Every plan's count is
    checked against Triton's own for sm_90 in tests/kernels/test_shared_memory.py.)"""
    return max(_tile_bytes(plan.gate_up, plan.grouped, 2, element_size),
               _tile_bytes(plan.down, plan.grouped, 1, element_size))


@functools.cache  # a few plans and dtypes per device: each fitted once
def fit_plan(plan: Plan, element_size: int, limit: int) -> Plan:
    """`plan` with each kernel's tile shrunk until it needs at most `limit` bytes of shared
    memory: a shallower pipeline first (down to 2 stages), then BLOCK_K, BLOCK_N and
    BLOCK_M halved, in that order. The plan itself where it fits."""
    low = 16 if plan.grouped else 1

    def fit(tile: Tile, weight_tiles: int) -> Tile:
        while _tile_bytes(tile, plan.grouped, weight_tiles, element_size) > limit:
            if tile.num_stages > 2:
                tile = dataclasses.replace(tile, num_stages=tile.num_stages - 1)
            elif tile.block_k > low:
                tile = dataclasses.replace(tile, block_k=tile.block_k // 2)
            elif tile.block_n > low:
                tile = dataclasses.replace(tile, block_n=tile.block_n // 2)
            elif plan.grouped and tile.block_m > low:
                tile = dataclasses.replace(tile, block_m=tile.block_m // 2)
            else:
                raise ValueError(f"fused_moe: no tile fits {limit:,} bytes of shared memory at "
                                 f"{element_size}-byte elements")
        return tile

    return Plan(plan.grouped, fit(plan.gate_up, 2), fit(plan.down, 1))


def shared_memory_limit(device: torch.device) -> int | None:
    """The most shared memory one program may use on `device` (what Triton checks a launch
    against: 232,448 bytes on an H100 or H200), None off CUDA (the interpreter has no limit)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin
