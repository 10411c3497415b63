"""Torch references for the kernels (float64 on the CPU), plus builders of random paged
KV caches shared by the kernel tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.kernels import fp8

# Block-table entries past a sequence's last block: far out of range, so a kernel that
# reads one faults (GPU) or raises (interpreter) instead of silently passing.
UNUSED_BLOCK = 1 << 30


@dataclass(frozen=True, slots=True)
class PagedKV:
    """A random paged cache. Slots no sequence owns hold NaN, so reading one poisons the result."""

    k_cache: torch.Tensor       # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [batch, max_blocks_per_seq] int32, shuffled
    seq_lens: torch.Tensor      # [batch] int32


def slot_mapping(block_tables: torch.Tensor, seq_idx: int, positions: range, block_size: int) -> list[int]:
    """Flat cache slots of `positions` of sequence `seq_idx`."""
    return [int(block_tables[seq_idx, p // block_size]) * block_size + p % block_size for p in positions]


def make_paged_kv(
    seq_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int,
    dtype: torch.dtype, device: torch.device | str, spare_blocks: int = 3, cache_dtype: torch.dtype | None = None,
) -> PagedKV:
    """K/V for every position of each sequence, scattered over randomly permuted blocks;
    cache_dtype KV_FP8: random values of dtype rounded as an FP8 cache holds them."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    perm = torch.randperm(num_blocks).tolist()
    max_blocks = max(blocks_per_seq) + 1
    block_tables = torch.full((len(seq_lens), max_blocks), UNUSED_BLOCK, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    for b, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        block_tables[b, :nb] = torch.tensor(perm[:nb], dtype=torch.int32)
        perm = perm[nb:]
        slots = torch.tensor(slot_mapping(block_tables, b, range(n), block_size))
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(n, num_kv_heads, head_dim).to(dtype)
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(n, num_kv_heads, head_dim).to(dtype)
    if cache_dtype == fp8.KV_FP8:
        k_cache, v_cache = fp8.quantize(k_cache), fp8.quantize(v_cache)  # NaN stays NaN
    return PagedKV(k_cache.to(device), v_cache.to(device), block_tables.to(device),
                   torch.tensor(seq_lens, dtype=torch.int32, device=device))


def ref_paged_attention(
    q: torch.Tensor, kv: PagedKV, q_lens: list[int], scale: float,
) -> torch.Tensor:
    """Causal attention of packed queries [num_tokens, num_q_heads, head_dim] over the paged
    cache, in float64 on q's device. Query i of sequence b sits at position
    seq_len_b - q_len_b + i."""
    q = q.double()
    k_all = kv.k_cache.double()
    v_all = kv.v_cache.double()
    device = q.device
    block_tables = kv.block_tables.cpu()
    block_size, num_kv_heads = k_all.shape[1], k_all.shape[2]
    group = q.shape[1] // num_kv_heads
    outs = []
    start = 0
    for b, q_len in enumerate(q_lens):
        seq_len = int(kv.seq_lens[b])
        slots = torch.tensor(slot_mapping(block_tables, b, range(seq_len), block_size), device=device)
        k = k_all.flatten(0, 1)[slots].repeat_interleave(group, dim=1)   # [seq_len, Hq, D]
        v = v_all.flatten(0, 1)[slots].repeat_interleave(group, dim=1)
        qb = q[start:start + q_len]                                       # [q_len, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", qb, k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
        scores = scores.masked_fill(torch.arange(seq_len, device=device)[None, :] > q_pos, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        start += q_len
    return torch.cat(outs)


def ref_cache_write(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the caches with each token whose slot is >= 0 written at its slot, in
    float32 for an FP8 cache (its values, `kernels.fp8.quantize`d)."""
    if k_cache.dtype == fp8.KV_FP8:
        key, value = fp8.quantize(key).float(), fp8.quantize(value).float()
        k_cache, v_cache = k_cache.float(), v_cache.float()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    k_ref.flatten(0, 1)[slots[keep].long()] = key[keep]
    v_ref.flatten(0, 1)[slots[keep].long()] = value[keep]
    return k_ref, v_ref


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN anywhere in out gives NaN (fails any bound)."""
    out, ref = out.double(), ref.double().to(out.device)
    return float((out - ref).norm() / ref.norm())


def tolerance(dtype: torch.dtype) -> float:
    """Relative-error bound per dtype (fp32 arithmetic lands far below its bound)."""
    return {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 1e-2}[dtype]


def rounding_tolerance(dtype: torch.dtype, roundings: int = 1) -> dict[str, float]:
    """`torch.testing.assert_close` bounds for a result `roundings` roundings to `dtype` away
    from the reference (a few ulps for fp32, whose arithmetic order differs)."""
    if dtype == torch.float32:
        return {"rtol": 1e-5, "atol": 1e-5}
    return {"rtol": roundings * torch.finfo(dtype).eps, "atol": 1e-5}


def ref_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * normalize(s), s) with s = x (+ residual), in x's dtype: the torch model's
    math (fp32 normalisation rounded to the dtype, then the weight)."""
    s = x if residual is None else x + residual
    sf = s.float()
    sf = sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * sf.to(s.dtype), s


def ref_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in float64; gate_up: [num_tokens, 2 * inter]."""
    gate, up = gate_up.double().chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


def rope_tables(head_dim: int, max_positions: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_positions, head_dim] float32, both halves equal (as engine/models/rope.py)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def ref_rotary(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin in float64; x: [num_tokens, num_heads, head_dim]."""
    x = x.double()
    cos = cos[positions.long()].double().unsqueeze(1)
    sin = sin[positions.long()].double().unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def ref_fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  first_expert: int = 0) -> torch.Tensor:
    """float64: sum over k of weights[t, k] * down(silu(gate(x[t])) * up(x[t])) of expert
    ids[t, k], for the experts held (first_expert .. first_expert + len(w13) - 1)."""
    x, w13, w2, weights = x.double().cpu(), w13.double().cpu(), w2.double().cpu(), weights.double().cpu()
    inter = w13.shape[1] // 2
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot]) - first_expert
            if not 0 <= e < w13.shape[0]:
                continue
            h = w13[e] @ x[t]
            out[t] += weights[t, slot] * (w2[e] @ (torch.nn.functional.silu(h[:inter]) * h[inter:]))
    return out


@dataclass(frozen=True, slots=True)
class PagedLatent:
    """A random paged MLA latent cache (one layer). Slots no sequence owns hold NaN."""

    cache: torch.Tensor         # [num_blocks, block_size, kv_lora_rank + rope_dim]
    block_tables: torch.Tensor  # [batch, max_blocks_per_seq] int32, shuffled
    seq_lens: torch.Tensor      # [batch] int32


def make_paged_latent(
    seq_lens: list[int], latent_dim: int, block_size: int, dtype: torch.dtype, device: torch.device | str,
    cache_dtype: torch.dtype | None = None,
) -> PagedLatent:
    """A latent row for every position of each sequence, over randomly permuted blocks, as
    the pool's [layers, 1, blocks, block_size, 1, latent_dim] holds one layer's (one "KV
    head" of the latent's width, taken out of `make_paged_kv`'s K cache)."""
    kv = make_paged_kv(seq_lens, 1, latent_dim, block_size, dtype, device, cache_dtype=cache_dtype)
    return PagedLatent(kv.k_cache[:, :, 0], kv.block_tables, kv.seq_lens)


def ref_mla_decode(
    q_nope: torch.Tensor, q_pe: torch.Tensor, latent: PagedLatent, q_lens: list[int], scale: float,
) -> torch.Tensor:
    """Absorbed MLA attention in float64: query token i of sequence b (packed, at position
    seq_len_b - q_len_b + i) scores each key's latent row as q_nope . c_kv + q_pe . k_pe and
    takes the softmax-weighted c_kv. Returns [num_tokens, num_heads, kv_lora_rank]."""
    q_nope, q_pe = q_nope.double(), q_pe.double()
    rank = q_nope.shape[-1]
    rows_all = latent.cache.double().flatten(0, 1)
    block_tables, block_size = latent.block_tables.cpu(), latent.cache.shape[1]
    device = q_nope.device
    outs, start = [], 0
    for b, q_len in enumerate(q_lens):
        seq_len = int(latent.seq_lens[b])
        rows = rows_all[torch.tensor(slot_mapping(block_tables, b, range(seq_len), block_size), device=device,
                                     dtype=torch.long)]
        c_kv, k_pe = rows[:, :rank], rows[:, rank:]
        qn, qp = q_nope[start:start + q_len], q_pe[start:start + q_len]
        scores = (torch.einsum("qhc,kc->hqk", qn, c_kv) + torch.einsum("qhr,kr->hqk", qp, k_pe)) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
        scores = scores.masked_fill(torch.arange(seq_len, device=device)[None, :] > q_pos, float("-inf"))
        outs.append(torch.einsum("hqk,kc->qhc", scores.softmax(-1), c_kv))
        start += q_len
    return torch.cat(outs)


def ref_mla_prefill(
    q_nope: torch.Tensor, q_pe: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor,
    q_lens: list[int], k_lens: list[int], scale: float,
) -> torch.Tensor:
    """Causal attention in float64 over packed per-head keys [k_nope, k_pe (shared by the
    heads, [num_k_tokens, rope_dim])] and values of another width; query i of sequence b
    sits at key position k_len_b - q_len_b + i. Returns [num_q_tokens, num_heads, v_dim]."""
    q = torch.cat([q_nope.double(), q_pe.double()], dim=-1)
    k = torch.cat([k_nope.double(), k_pe.double()[:, None, :].expand(-1, k_nope.shape[1], -1)], dim=-1)
    v, device = v.double(), q.device
    outs, q0, k0 = [], 0, 0
    for q_len, k_len in zip(q_lens, k_lens):
        scores = torch.einsum("qhd,khd->hqk", q[q0:q0 + q_len], k[k0:k0 + k_len]) * scale
        q_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
        scores = scores.masked_fill(torch.arange(k_len, device=device)[None, :] > q_pos, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[k0:k0 + k_len]))
        q0, k0 = q0 + q_len, k0 + k_len
    return torch.cat(outs)
