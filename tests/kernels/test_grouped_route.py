"""grouped_topk_route (DeepSeek-V2's "group_limited_greedy", V3's "noaux_tc") against the
engine's torch routing (`moe.grouped_route`, transformers' ops): 1 to 200 tokens, V2's and
V3's expert counts and groups and the engine tests' tiny configs, non-zero correction biases;
on equal scores against the same ops with the lowest id taken first; bad arguments refused."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.models.arch import MoEArch
from pdserve.engine.models.moe import grouped_route
from pdserve.kernels.moe_routing import grouped_topk_route

COVERS = ("grouped_topk_route",)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (routing, experts, n_group, topk_group, top_k, norm_topk_prob, routed_scaling_factor)
CONFIGS = {
    "v3": ("noaux_tc", 256, 8, 4, 8, True, 2.5),                   # DeepSeek-V3 / R1
    "v2": ("group_limited_greedy", 160, 8, 3, 6, False, 16.0),     # DeepSeek-V2 (groups of 20)
    "tiny-v3": ("noaux_tc", 8, 4, 2, 2, True, 2.5),                # tests/engine/test_deepseek.py
    "tiny-v3-one-group": ("noaux_tc", 8, 1, 1, 2, False, 1.0),
    "tiny-v2": ("group_limited_greedy", 8, 4, 2, 2, False, 1.0),
    "every-group": ("noaux_tc", 64, 8, 8, 8, False, 1.0),
    "one-group-kept-whole": ("group_limited_greedy", 32, 4, 1, 8, True, 1.0),
    "odd-groups": ("noaux_tc", 60, 3, 2, 5, True, 1.5),
}


def _moe(name: str) -> MoEArch:
    routing, experts, groups, topk_group, top_k, norm, scale = CONFIGS[name]
    return MoEArch(num_experts=experts, top_k=top_k, intermediate_size=8, norm_topk_prob=norm, routing=routing,
                   num_groups=groups, topk_group=topk_group, routed_scaling_factor=scale)


def _fused(logits: torch.Tensor, moe: MoEArch, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    weights, ids = grouped_topk_route(logits.to(DEVICE), moe.routing, moe.top_k, moe.num_groups, moe.topk_group,
                                      moe.norm_topk_prob, moe.routed_scaling_factor,
                                      None if bias is None else bias.to(DEVICE))
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    return weights.cpu(), ids.cpu()


def _by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's (weights, ids) ordered by id: the experts' order does not matter."""
    ids, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids


def _assert_same_routing(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    got_w, got_ids = _by_id(*got)
    want_w, want_ids = _by_id(*want)
    assert torch.equal(got_ids, want_ids), (got_ids != want_ids).any(dim=-1).nonzero().flatten().tolist()
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-7)  # the GPU's exp is ex2.approx


def _inputs(name: str, num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    moe = _moe(name)
    gen = torch.Generator().manual_seed(seed)
    logits = 2 * torch.randn(num_tokens, moe.num_experts, generator=gen)
    bias = 0.5 * torch.randn(moe.num_experts, generator=gen) if moe.routing == "noaux_tc" else None
    return logits, bias


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("num_tokens", [1, 13, 200])
def test_the_kernel_routes_as_the_torch_ops(name, num_tokens):
    moe = _moe(name)
    logits, bias = _inputs(name, num_tokens, seed=num_tokens)
    got = _fused(logits, moe, bias)
    _assert_same_routing(got, grouped_route(logits, moe, bias, fused=False))
    if bias is not None and num_tokens == 200:  # the bias moves choices, and the kernel follows it
        unbiased = _by_id(*grouped_route(logits, moe, torch.zeros_like(bias), fused=False))[1]
        assert not torch.equal(_by_id(*got)[1], unbiased)


def test_a_v3_router_without_its_bias_routes_by_the_scores_alone():
    moe = _moe("v3")
    logits, _ = _inputs("v3", 9, seed=1)
    _assert_same_routing(_fused(logits, moe, None), grouped_route(logits, moe, None, fused=False))


def _lowest_first(values: torch.Tensor, k: int) -> torch.Tensor:
    return torch.sort(values, dim=-1, descending=True, stable=True)[1][:, :k]


def _lowest_id_reference(logits: torch.Tensor, moe: MoEArch,
                         bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """grouped_route's ops with torch.topk's choices made by a stable sort: among equal
    scores (or group scores) the lowest id, as the kernel takes them."""
    sigmoid = moe.routing == "noaux_tc"
    scores = logits.sigmoid() if sigmoid else logits.softmax(dim=-1)
    choice = scores + bias if bias is not None else scores
    grouped = choice.view(len(logits), moe.num_groups, -1)
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1) if sigmoid else grouped.amax(dim=-1)
    kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, _lowest_first(group_scores, moe.topk_group),
                                                                     True)
    in_kept = kept.repeat_interleave(moe.num_experts // moe.num_groups, dim=1)
    ids = _lowest_first(choice.masked_fill(~in_kept, float("-inf")), moe.top_k)
    weights = scores.gather(1, ids)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling_factor, ids


@pytest.mark.parametrize("name", CONFIGS)
def test_equal_scores_and_equal_groups_go_to_the_lowest_id(name):
    """Logits from five values: most experts tie, and so do groups' scores (a constant bias
    keeps equal scores equal). torch.topk's choice among equals is its own, so the reference
    is its ops with the lowest id taken; taking the highest instead must route differently."""
    moe = _moe(name)
    gen = torch.Generator().manual_seed(7)
    logits = torch.randint(-2, 3, (40, moe.num_experts), generator=gen).float() / 2
    bias = torch.full((moe.num_experts,), 0.25) if moe.routing == "noaux_tc" else None
    want = _lowest_id_reference(logits, moe, bias)
    _assert_same_routing(_fused(logits, moe, bias), want)
    highest_first = moe.num_experts - 1 - _lowest_id_reference(logits.flip(-1), moe, bias)[1]
    assert not torch.equal(_by_id(*want)[1], highest_first.sort(dim=-1)[0])


def test_the_lowest_id_rule_on_a_hand_case():
    # Groups of two: group scores (biased two best) 1.0, 1.0, 1.0, 0.2 -> groups 0 and 1 kept.
    logits = torch.logit(torch.tensor([[0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.1, 0.1]]))
    weights, ids = grouped_topk_route(logits.to(DEVICE), "noaux_tc", 3, 4, 2, False, 1.0)
    assert ids.tolist() == [[0, 1, 2]]
    torch.testing.assert_close(weights.cpu(), torch.full((1, 3), 0.5))


def test_no_tokens():
    weights, ids = grouped_topk_route(torch.zeros(0, 8, device=DEVICE), "noaux_tc", 2, 4, 2, True, 1.0)
    assert weights.shape == ids.shape == (0, 2)


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(routing="softmax"), "routing must be one of"),
    (dict(num_groups=3), "num_groups 3 must divide the 8 experts"),
    (dict(topk_group=5), "topk_group must be in 1..4"),
    (dict(top_k=5), "top_k must be in 1..4"),
    (dict(num_groups=8, topk_group=2), "two best experts; groups of 1"),
    (dict(routing="group_limited_greedy", correction_bias=torch.zeros(8)), "correction_bias"),
    (dict(correction_bias=torch.zeros(7)), "correction_bias must be a contiguous \\[8\\]"),
    (dict(router_logits=torch.zeros(8, 3).t()), "contiguous"),
])
def test_bad_arguments_are_refused_by_name(kwargs, match):
    args = dict(router_logits=torch.zeros(3, 8), routing="noaux_tc", top_k=2, num_groups=4, topk_group=2,
                renormalize=True, scaling_factor=1.0, correction_bias=None) | kwargs
    with pytest.raises(ValueError, match=match):
        grouped_topk_route(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["v3", "v2"])
def test_a_cuda_graph_replays_the_routing_of_new_logits(name):
    """No host sync, sizes from T alone: captured once, the graph routes the logits written
    into its input afterwards (V3's bias read at replay too)."""
    moe = _moe(name)
    logits, bias = _inputs(name, 64, seed=3)
    static, static_bias = logits.cuda(), None if bias is None else bias.cuda()

    def launch() -> tuple[torch.Tensor, torch.Tensor]:
        return grouped_topk_route(static, moe.routing, moe.top_k, moe.num_groups, moe.topk_group,
                                  moe.norm_topk_prob, moe.routed_scaling_factor, static_bias)

    launch()  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = launch()
    fresh, fresh_bias = _inputs(name, 64, seed=4)
    static.copy_(fresh)
    if static_bias is not None:
        static_bias.copy_(fresh_bias)
    graph.replay()
    _assert_same_routing((weights.cpu(), ids.cpu()), grouped_route(fresh, moe, fresh_bias, fused=False))


@pytest.mark.gpu
def test_bf16_logits_are_widened_as_they_are_read():
    """bf16 logits repeat (8 bits of mantissa): the lowest-id reference, not torch.topk's ties."""
    moe = _moe("v3")
    logits, _ = _inputs("v3", 100, seed=5)
    logits = logits.bfloat16()
    bias = torch.full((moe.num_experts,), 0.125)
    _assert_same_routing(_fused(logits, moe, bias), _lowest_id_reference(logits.float(), moe, bias))
