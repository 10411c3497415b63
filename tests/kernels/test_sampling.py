"""gumbel_argmax: temperature-0 rows are torch's argmax (first of ties, -inf entries, the
maximum in any block of the vocabulary); other rows are draws from softmax(row / T)
(chi-square against the exact distribution, over thousands of independent rows, with
the mass spread across blocks); a seed gives the same draws again, another seed others."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.kernels.sampling import BLOCK, gumbel_argmax
from tests.engine.speculative.stats import chi_square_pvalue

COVERS = ("gumbel_argmax",)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _seed(value: int) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int64, device=DEVICE)


def test_temperature_zero_is_the_first_argmax():
    vocab = BLOCK + 300  # two blocks, the second partial
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, vocab, generator=gen)
    logits[1, 7] = logits[1, BLOCK + 5] = 50.0  # a tie across blocks: the first wins
    logits[2, :] = float("-inf")
    logits[2, BLOCK + 299] = 1.0  # the last column
    logits[3, : BLOCK] = float("-inf")  # the whole first block masked (a grammar)
    logits = logits.to(DEVICE)
    out = gumbel_argmax(logits, torch.zeros(6, device=DEVICE), _seed(1))
    assert out.dtype == torch.int64
    assert out.tolist() == logits.argmax(dim=-1).tolist()
    assert out[1].item() == 7 and out[2].item() == BLOCK + 299


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_draws_follow_the_softmax_at_the_temperature(temperature):
    # 200 draws: the expected chi-square against the other temperature's distribution is 64
    # at 1.0 and 120 at 0.6 (p ~ 3e-13, 2e-25), far past the 1e-6 asked; each row is a program of
    # Triton's interpreter on the CPU (600 took ~70 s of CI's time per temperature).
    rows, vocab = 200, BLOCK + 64
    hot = [3, 900, BLOCK - 1, BLOCK, BLOCK + 63]  # the mass, in both blocks
    row = torch.full((vocab,), float("-inf"))
    row[hot] = torch.tensor([0.0, 1.0, -0.5, 2.0, 0.5])
    logits = row.expand(rows, vocab).contiguous().to(DEVICE)
    out = gumbel_argmax(logits, torch.full((rows,), temperature, device=DEVICE), _seed(1234)).cpu()
    assert set(out.tolist()) <= set(hot)
    counts = torch.bincount(out, minlength=vocab)[hot]
    exact = torch.softmax(row[hot] / temperature, dim=0)
    assert chi_square_pvalue(counts, exact) > 1e-3
    # ...and not the distribution of another temperature (the test can tell them apart).
    other = torch.softmax(row[hot] / (temperature * 3), dim=0)
    assert chi_square_pvalue(counts, other) < 1e-6


def test_a_seed_repeats_its_draws_and_rows_mix_greedy_and_sampled():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 500, generator=gen).to(DEVICE)
    temps = torch.tensor([0.0 if i % 4 == 0 else 1.0 for i in range(64)], device=DEVICE)
    a = gumbel_argmax(logits, temps, _seed(7))
    b = gumbel_argmax(logits, temps, _seed(7))
    c = gumbel_argmax(logits, temps, _seed(8))
    assert a.tolist() == b.tolist()
    assert a[::4].tolist() == logits[::4].argmax(dim=-1).tolist()  # greedy rows ignore the seed
    sampled = [i for i in range(64) if i % 4]
    assert a[sampled].tolist() != c[sampled].tolist()
    assert not math.isnan(float(a.float().mean()))
