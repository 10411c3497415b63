"""fused_moe against the float64 reference: 1 to 512 tokens, 4 to 64 experts, top-k 1 to 8,
experts that receive no token, every token on one expert, another rank's experts (expert
parallelism), and the engine's CPU path (moe.experts_reference) on the same inputs."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.models.moe import experts_reference, route
from pdserve.kernels.fused_moe import fused_moe
from tests.kernels.reference import ref_fused_moe, rel_error, tolerance

COVERS = ("fused_moe",)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int, dtype: torch.dtype,
            seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE, dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(DEVICE, dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5).to(DEVICE, dtype)
    logits = torch.randn(num_tokens, num_experts, generator=gen).to(DEVICE)
    weights, ids = route(logits, top_k, renormalize=True)
    return x, w13, w2, weights, ids


# (tokens, hidden, intermediate, experts, top_k): sizes across the tiles, and the edges.
CASES = [
    (1, 32, 32, 4, 1),
    (1, 64, 16, 64, 8),     # one token, most experts idle
    (5, 64, 48, 8, 2),      # intermediate past one column tile of 32
    (33, 48, 32, 16, 4),    # hidden not a multiple of the K tile
    (48, 16, 16, 8, 8),     # every expert of every token
    (512, 16, 16, 4, 1),
]


@pytest.mark.parametrize(("num_tokens", "hidden", "inter", "num_experts", "top_k"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_moe_matches_the_reference(num_tokens, hidden, inter, num_experts, top_k, dtype):
    x, w13, w2, weights, ids = _inputs(num_tokens, hidden, inter, num_experts, top_k, dtype)
    out = fused_moe(x, w13, w2, weights, ids, block_n=32)
    assert out.shape == (num_tokens, hidden) and out.dtype == dtype
    assert rel_error(out, ref_fused_moe(x, w13, w2, weights, ids)) < tolerance(dtype)


def test_every_token_on_one_expert_and_experts_with_none():
    x, w13, w2, weights, _ = _inputs(40, 32, 16, 8, 2, torch.float32)
    ids = torch.tensor([[3, 5]] * 40, device=DEVICE)  # experts 3 and 5 get all 40, the other six none
    out = fused_moe(x, w13, w2, weights, ids)
    assert rel_error(out, ref_fused_moe(x, w13, w2, weights, ids)) < tolerance(torch.float32)


def test_another_ranks_experts_contribute_nothing():
    """Expert parallelism: this rank holds experts 4..7 of 8; tokens routed elsewhere get
    only their local experts' share (zero when none is local)."""
    x, w13, w2, weights, ids = _inputs(24, 32, 16, 8, 2, torch.float32, seed=3)
    ids[0] = torch.tensor([0, 1])  # nothing here for token 0
    local = slice(4, 8)
    out = fused_moe(x, w13[local].contiguous(), w2[local].contiguous(), weights, ids, first_expert=4)
    ref = ref_fused_moe(x, w13[local], w2[local], weights, ids, first_expert=4)
    assert rel_error(out, ref) < tolerance(torch.float32)
    assert (out[0] == 0).all()


def test_the_engines_cpu_path_is_the_same_function():
    x, w13, w2, weights, ids = _inputs(17, 32, 16, 8, 2, torch.float32, seed=5)
    got = experts_reference(x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu())
    assert rel_error(got, ref_fused_moe(x, w13, w2, weights, ids)) < tolerance(torch.float32)
    assert rel_error(fused_moe(x, w13, w2, weights, ids).cpu(), got) < tolerance(torch.float32)


def test_no_tokens():
    x, w13, w2, weights, ids = _inputs(0, 32, 16, 4, 2, torch.float32)
    assert fused_moe(x, w13, w2, weights, ids).shape == (0, 32)


@pytest.mark.parametrize(("change", "match"), [
    (lambda a: {**a, "w13": a["w13"][:, :, :16]}, "w13 must be a contiguous"),
    (lambda a: {**a, "w2": a["w2"].transpose(1, 2)}, "w2 must be a contiguous"),
    (lambda a: {**a, "w13": a["w13"].half()}, "x's dtype"),
    (lambda a: {**a, "ids": a["ids"][:, :1]}, "ids and weights"),
    (lambda a: {**a, "block_m": 24}, "block_m must be a power of two"),
])
def test_bad_input_is_refused_by_name(change, match):
    x, w13, w2, weights, ids = _inputs(4, 32, 16, 4, 2, torch.float32)
    args = change(dict(x=x, w13=w13, w2=w2, weights=weights, ids=ids))
    with pytest.raises(ValueError, match=match):
        fused_moe(**args)


@pytest.mark.gpu
@pytest.mark.parametrize(("num_tokens", "hidden", "inter", "num_experts", "top_k"), [
    (1, 2048, 768, 128, 8), (64, 2048, 768, 128, 8), (256, 2048, 768, 128, 8),  # Qwen3-30B-A3B
    (1, 4096, 14336, 8, 2), (128, 4096, 14336, 8, 2),  # Mixtral-8x7B
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_moe_gpu_real_sizes(num_tokens, hidden, inter, num_experts, top_k, dtype):
    x, w13, w2, weights, ids = _inputs(num_tokens, hidden, inter, num_experts, top_k, dtype)
    out = fused_moe(x, w13, w2, weights, ids)
    assert rel_error(out, ref_fused_moe(x, w13, w2, weights, ids)) < tolerance(dtype)
