"""write_latents against torch's row writes (`fp8.quantize` for an FP8 cache): every token
with a slot has exactly its [kv_c | k_pe] row there, in the cache's dtype; a token with a
negative slot (a padded CUDA-graph row) and every slot no token names keep what they held
(a NaN sentinel, so a stray write shows). Strided views in, as the model hands them. With
`rope`, k_pe is written rotated and the queries' rope part rotated in place, against the
float64 rotation (`ref_rotary`), the queries' other part untouched, padded tokens' queries
rotated too."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import fp8
from pdserve.kernels.mla_cache import write_latents
from tests.kernels.reference import ref_rotary, rope_tables, rounding_tolerance

COVERS = ("write_latents",)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


CASES = [(dtype, cache_dtype, rank, rope)
         for dtype, cache_dtype in [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.bfloat16, fp8.KV_FP8)]
         for rank, rope in [(32, 8), (512, 64), (24, 6)]]


@pytest.mark.parametrize("dtype, cache_dtype, rank, rope", CASES)
def test_each_token_writes_its_latent_row_and_padding_writes_nothing(dtype, cache_dtype, rank, rope):
    num_blocks, block_size = 6, 4
    gen = torch.Generator().manual_seed(rank + rope)
    # Latents from one wider projection, as the model splits them (strided rows).
    latent = (torch.randn(9, rank + rope + 3, generator=gen) * 3).to(DEVICE, dtype)
    kv_c, k_pe = latent[:, :rank], latent[:, rank:rank + rope]
    slots = torch.tensor([5, -1, 0, 23, 7, -1, 12, 1, 22], dtype=torch.int64, device=DEVICE)
    sentinel = torch.full((num_blocks, block_size, rank + rope), float("nan"), dtype=torch.float32)
    cache = sentinel.to(cache_dtype).to(DEVICE)
    write_latents(cache, slots, kv_c, k_pe)
    want = sentinel.view(-1, rank + rope).clone()
    rows = torch.cat((kv_c, k_pe), dim=-1).cpu()
    rows = fp8.quantize(rows) if cache_dtype == fp8.KV_FP8 else rows.to(cache_dtype)
    keep = slots.cpu() >= 0
    want[slots.cpu()[keep]] = rows[keep].float()
    got = cache.float().cpu().view(-1, rank + rope)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_int32_slots_and_no_tokens():
    cache = torch.zeros(2, 4, 16 + 16, device=DEVICE)
    kv_c, k_pe = torch.randn(3, 16, device=DEVICE), torch.randn(3, 16, device=DEVICE)
    write_latents(cache, torch.tensor([7, -1, 2], dtype=torch.int32, device=DEVICE), kv_c, k_pe)
    flat = cache.view(8, 32)
    torch.testing.assert_close(flat[7], torch.cat((kv_c[0], k_pe[0])), rtol=0, atol=0)
    torch.testing.assert_close(flat[2], torch.cat((kv_c[2], k_pe[2])), rtol=0, atol=0)
    assert flat[[0, 1, 3, 4, 5, 6]].abs().sum() == 0
    write_latents(cache, torch.zeros(0, dtype=torch.int64, device=DEVICE), kv_c[:0], k_pe[:0])  # nothing to write
    assert flat[[0, 1, 3, 4, 5, 6]].abs().sum() == 0


ROTATE_CASES = [(torch.float32, torch.float32, 32, 16, 3), (torch.bfloat16, torch.bfloat16, 512, 64, 16),
                (torch.bfloat16, fp8.KV_FP8, 32, 6, 2)]


@pytest.mark.parametrize("dtype, cache_dtype, rank, rope, heads", ROTATE_CASES)
def test_rotated_on_the_way_k_pe_in_the_cache_and_q_pe_in_place(dtype, cache_dtype, rank, rope, heads):
    gen = torch.Generator().manual_seed(rope)
    cos, sin = rope_tables(rope, 64)
    positions = torch.tensor([5, 0, 63, 17, 2], device=DEVICE)
    slots = torch.tensor([3, -1, 9, 0, 30], device=DEVICE)
    nope = 24
    q = torch.randn(5, heads, nope + rope, generator=gen).to(DEVICE, dtype)
    kv_c = torch.randn(5, rank, generator=gen).to(DEVICE, dtype)
    k_pe = torch.randn(5, rope, generator=gen).to(DEVICE, dtype)
    q_before, k_before = q.clone(), k_pe.clone()
    cache = torch.full((8, 4, rank + rope), float("nan")).to(cache_dtype).to(DEVICE)
    write_latents(cache, slots, kv_c, k_pe, rope=(q[..., nope:], positions, cos.to(DEVICE), sin.to(DEVICE)))
    tol = rounding_tolerance(dtype)
    want_q = ref_rotary(q_before[..., nope:].cpu(), positions.cpu(), cos, sin)
    torch.testing.assert_close(q[..., nope:].cpu().double(), want_q, **tol)
    assert torch.equal(q[..., :nope], q_before[..., :nope]) and torch.equal(k_pe, k_before)
    want_k = ref_rotary(k_before.unsqueeze(1).cpu(), positions.cpu(), cos, sin)[:, 0]
    rows = cache.float().cpu().view(-1, rank + rope)
    keep = slots.cpu() >= 0
    got_c, got_k = rows[slots.cpu()[keep], :rank], rows[slots.cpu()[keep], rank:]
    torch.testing.assert_close(got_c, kv_c.cpu()[keep].to(cache_dtype).float(), rtol=0, atol=0)
    if cache_dtype == fp8.KV_FP8:  # within one e4m3 step (3 mantissa bits) of the exact rotation
        torch.testing.assert_close(got_k.double(), want_k[keep], rtol=2 ** -3, atol=2 ** -9)
    else:
        torch.testing.assert_close(got_k.double(), want_k[keep], **tol)
    untouched = torch.ones(rows.shape[0], dtype=torch.bool)
    untouched[slots.cpu()[keep]] = False
    assert rows[untouched].isnan().all()


@pytest.mark.gpu
def test_on_the_gpu_every_case_writes_as_torch_does():
    """The cases above on the GPU (the device-side rounding to e4m3 included)."""
    assert DEVICE == "cuda"
    for case in CASES:
        test_each_token_writes_its_latent_row_and_padding_writes_nothing(*case)
    for case in ROTATE_CASES:
        test_rotated_on_the_way_k_pe_in_the_cache_and_q_pe_in_place(*case)
    test_int32_slots_and_no_tokens()
