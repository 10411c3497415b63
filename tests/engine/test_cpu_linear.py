"""The CPU's prepacked bf16 linear (engine.models.cpu_linear) against nn.functional.linear."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.models.cpu_linear import PackedWeight, cpu_packed_bf16
from pdserve.engine.models.layers import Linear

pytestmark = pytest.mark.skipif(not cpu_packed_bf16(), reason="this CPU's oneDNN has no bf16 linear")


def _layer(bias: bool) -> Linear:
    torch.manual_seed(0)
    layer = Linear(576, 960, bias=bias).to(torch.bfloat16)
    layer.requires_grad_(False)
    return layer


@pytest.mark.parametrize("rows", [1, 7, 32, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_product_equals_functional_linear_bit_for_bit(rows, bias):
    layer = _layer(bias)
    x = torch.randn(rows, 576, dtype=torch.bfloat16)
    with torch.inference_mode():
        out = layer(x)
        assert layer._packed is not None  # the packed path ran
        torch.testing.assert_close(out, torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=0, atol=0)


def test_packing_follows_a_weight_written_in_place_or_replaced():
    layer = _layer(False)
    x = torch.randn(4, 576, dtype=torch.bfloat16)
    with torch.inference_mode():
        layer(x)
    first = layer._packed
    with torch.inference_mode():
        layer(x)
    assert layer._packed is first  # reused while the weight is unchanged
    with torch.no_grad():
        layer.weight.mul_(-2)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight), rtol=0, atol=0)
    layer.weight = torch.nn.Parameter(torch.randn(960, 576, dtype=torch.bfloat16), requires_grad=False)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight), rtol=0, atol=0)


def test_with_autograd_on_it_stays_on_functional_linear():
    layer = _layer(False).requires_grad_(True)
    x = torch.randn(3, 576, dtype=torch.bfloat16)
    out = layer(x)
    assert layer._packed is None and out.requires_grad
    out.sum().backward()
    assert layer.weight.grad is not None


def test_pack_of_keeps_a_held_packing_only_for_its_own_weight():
    a = torch.randn(8, 16, dtype=torch.bfloat16)
    held = PackedWeight.of(a, None)
    assert PackedWeight.of(a, held) is held
    assert PackedWeight.of(a.clone(), held) is not held
