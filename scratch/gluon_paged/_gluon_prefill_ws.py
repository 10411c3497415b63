"""The Gluon kernel behind kernels.flash_prefill_ws (which checks arguments and falls
back cleanly where Gluon, an experimental Triton dialect, is missing or has changed):
FA3-style causal prefill for Hopper (sm_90) over packed sequences' own K/V.

One program owns 128 query rows of one (sequence, query head) and runs three roles:

- a 1-warp producer loads the two Q halves once, then streams 128-row K and V tiles of
  the sequence's KV head into a NUM_STAGES-deep shared-memory ring by TMA; each slot
  has a ready barrier (TMA bytes arrived) and an empty barrier (both consumers done);
- two consumer warpgroups own 64 query rows each and walk the same K/V tiles. Each
  overlaps inside itself (tile j's S = Q K_j^T is issued together with tile j-1's
  O += P V_{j-1}; the softmax of S_j runs while P V_{j-1} is still on the tensor cores)
  and with the other ("ping-pong"): a pair of turn barriers lets the warpgroups issue
  their matrix products strictly in turn, so one warpgroup's softmax runs while the
  other's products occupy the tensor cores (FlashAttention-3, Shah et al. 2024).
  In the SASS only the second kind survives: ptxas moves the last wgmma wait of a step
  above the exp2s (a two-steps-per-iteration variant kept both but spilled and ran 12%
  slower at 8k, so it was dropped).

Tiles left of the diagonal run unmasked; only the last tile (the diagonal, which is also
where the sequence ends) and the first (which is the diagonal for the first query tile)
are masked. Rows past the sequence end compute garbage that is never stored.

launch_paged runs the same roles over the paged KV cache (flash_prefill's semantics, all
keys 0 .. seq_len - 1 read from the cache, so prompts with earlier context work too): the
producer gathers each 128-row K/V tile as one TMA box per cache block into row slices of
the ring slot (see _producer_paged), and the consumers offset query positions by the
context length; tiles wholly at or left of the block's first query position run
unmasked, the one or two tiles holding the diagonal are masked.
"""

# No `from __future__ import annotations`: the aggregate below type-checks its fields
# against the real annotation objects.
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.core import _aggregate as aggregate

LOG2E = 1.4426950408889634
HEAD_DIM = 128
BLOCK_M = 128       # query rows per program: two consumer warpgroups of WG_M rows
WG_M = 64
BLOCK_N = 128       # key/value rows per tile
# K/V ring depth: Q 32 KB + 2 x (K 32 KB + V 32 KB) + the output's layout change = 176 KB of
# shared memory; a third stage would need 240 KB, past the 227 KB an SM gives one program.
NUM_STAGES = 2
# Registers per thread: the consumer worker asks for 240 (the default partition, the other
# consumer, gets what maxnreg leaves: 168 * 384 - 240 * 128 - 24 * 128 = 240 each).
CONSUMER_REGS = gl.constexpr(240)
PRODUCER_REGS = gl.constexpr(24)
MAXNREG = 168


@aggregate
class _Smem:
    """Shared-memory buffers and the barriers that hand them between the roles."""

    q: gl.shared_memory_descriptor        # [2, WG_M, HEAD_DIM], one half per consumer
    k: gl.shared_memory_descriptor        # [NUM_STAGES, BLOCK_N, HEAD_DIM]
    v: gl.shared_memory_descriptor        # [NUM_STAGES, BLOCK_N, HEAD_DIM]
    q_ready: gl.shared_memory_descriptor  # [1, 1]: both Q halves landed
    k_ready: gl.shared_memory_descriptor  # [NUM_STAGES, 1]: TMA bytes arrived (count 1 + tx)
    v_ready: gl.shared_memory_descriptor
    k_empty: gl.shared_memory_descriptor  # [NUM_STAGES, 1]: both consumers done (count 2)
    v_empty: gl.shared_memory_descriptor
    turn: gl.shared_memory_descriptor     # [2, 1]: turn[w] lets consumer w issue its products

    @gluon.constexpr_function
    def __init__(self, q, k, v, q_ready, k_ready, v_ready, k_empty, v_empty, turn):
        self.q = q
        self.k = k
        self.v = v
        self.q_ready = q_ready
        self.k_ready = k_ready
        self.v_ready = v_ready
        self.k_empty = k_empty
        self.v_empty = v_empty
        self.turn = turn


@gluon.jit
def _producer(smem, q_desc, k_desc, v_desc, q_row0, q_col, kv_row0, kv_col, num_tiles):
    """1 warp: Q once, then K_j and V_j for j < num_tiles into the ring."""
    STAGES: gl.constexpr = smem.k.shape[0]
    q_bar = smem.q_ready.index(0)
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row0, q_col], q_bar, smem.q.index(0))
    tma.async_copy_global_to_shared(q_desc, [q_row0 + q_desc.block_type.shape[0], q_col], q_bar, smem.q.index(1))
    for j in range(num_tiles):
        stage = j % STAGES
        # A fresh barrier passes a wait on parity 1: the first lap needs no release.
        phase = ((j // STAGES) & 1) ^ 1
        row = kv_row0 + j * k_desc.block_type.shape[0]
        mbarrier.wait(smem.k_empty.index(stage), phase)
        mbarrier.expect(smem.k_ready.index(stage), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row, kv_col], smem.k_ready.index(stage), smem.k.index(stage))
        mbarrier.wait(smem.v_empty.index(stage), phase)
        mbarrier.expect(smem.v_ready.index(stage), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row, kv_col], smem.v_ready.index(stage), smem.v.index(stage))


@gluon.jit
def _producer_paged(smem, q_desc, k_desc, v_desc, q_row0, q_col, bt_ptr, last_page, kv_col, num_tiles):
    """1 warp: Q once, then K_j and V_j for j < num_tiles from the paged cache, each tile
    gathered as BLOCK_N // PAGE boxes of PAGE rows (one per cache block) into consecutive
    row slices of the ring slot. All boxes of a tile complete on the slot's one ready
    barrier, which expects the whole tile's bytes: every box is always issued, its page
    index clamped to last_page (the sequence's last block this program needs), so the
    bytes that land always equal the expectation and no block-table entry past the
    sequence is read; the keys of clamped duplicate pages lie past the diagonal and the
    consumers mask them."""
    STAGES: gl.constexpr = smem.k.shape[0]
    BN: gl.constexpr = smem.k.shape[1]
    PAGE: gl.constexpr = k_desc.block_type.shape[0]
    PAGES: gl.constexpr = BN // PAGE
    q_bar = smem.q_ready.index(0)
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row0, q_col], q_bar, smem.q.index(0))
    tma.async_copy_global_to_shared(q_desc, [q_row0 + q_desc.block_type.shape[0], q_col], q_bar, smem.q.index(1))
    # Lane i holds the tile's i-th block id (one coalesced load per tile, issued before
    # the waits so its latency hides behind them); each box takes it out with a warp
    # reduction. Eight scalar loads in flight would not fit the producer's 24 registers.
    lanes: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    offs = gl.arange(0, 32, layout=lanes)
    for j in range(num_tiles):
        stage = j % STAGES
        phase = ((j // STAGES) & 1) ^ 1
        ids = gl.load(bt_ptr + gl.minimum(j * PAGES + offs, last_page), mask=offs < PAGES, other=0)
        k_buf = smem.k.index(stage)
        v_buf = smem.v.index(stage)
        mbarrier.wait(smem.k_empty.index(stage), phase)
        mbarrier.expect(smem.k_ready.index(stage), PAGES * k_desc.block_type.nbytes)
        for i in gl.static_range(PAGES):
            row = gl.sum(gl.where(offs == i, ids, 0), axis=0) * PAGE
            tma.async_copy_global_to_shared(k_desc, [row, kv_col], smem.k_ready.index(stage),
                                            k_buf.slice(i * PAGE, PAGE, dim=0))
        mbarrier.wait(smem.v_empty.index(stage), phase)
        mbarrier.expect(smem.v_ready.index(stage), PAGES * v_desc.block_type.nbytes)
        for i in gl.static_range(PAGES):
            row = gl.sum(gl.where(offs == i, ids, 0), axis=0) * PAGE
            tma.async_copy_global_to_shared(v_desc, [row, kv_col], smem.v_ready.index(stage),
                                            v_buf.slice(i * PAGE, PAGE, dim=0))


@gluon.jit
def _wait_turn(smem, event, WG: gl.constexpr):
    """Block until the other consumer has issued its products for the previous event:
    consumer 0's event e needs e arrivals of consumer 1 (parity trick: a fresh barrier
    passes parity 1), consumer 1's event e needs e + 1 arrivals of consumer 0."""
    mbarrier.wait(smem.turn.index(WG), (event & 1) ^ (1 - WG))


@gluon.jit
def _softmax(s, m_i, l_i, row0, col0, scale_log2, MASKED: gl.constexpr):
    """Online-softmax step on raw scores s [WG_M, BLOCK_N] of query rows row0.. and key
    columns col0.. (indices in the sequence): returns p (fp32, unnormalized), the rescale
    factor alpha of the old state, and the new running max and sum."""
    if MASKED:
        # Built here, not passed in: a column index vector kept live across the unmasked
        # loop costs 32 registers per thread.
        rows = row0 + gl.arange(0, s.shape[0], layout=gl.SliceLayout(1, s.type.layout))
        cols = col0 + gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s.type.layout))
        s = gl.where(gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1), s, float("-inf"))
    # The scale sits inside the exponent (one FMA per score), as in flash_prefill.
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * scale_log2)
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s * scale_log2 - gl.expand_dims(m_new, 1))
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_i


@gluon.jit
def _step(smem, q_s, s_zero, p, o, m_i, l_i, j, stage, prev, row0, scale_log2,
          WG: gl.constexpr, MASKED: gl.constexpr):
    """Event j (1 <= j < num_tiles): issue S_j = Q K_j^T and O += P_{j-1} V_{j-1}, then do
    tile j's softmax while the second product runs (FA3's order for head dim 128).
    stage = j % NUM_STAGES and prev = (j - 1) % NUM_STAGES, constexpr where the caller
    knows them (constant shared-memory addresses: fewer registers)."""
    STAGES: gl.constexpr = smem.k.shape[0]
    BN: gl.constexpr = smem.k.shape[1]
    _wait_turn(smem, j, WG)
    mbarrier.wait(smem.k_ready.index(stage), (j // STAGES) & 1)
    s = warpgroup_mma(q_s, smem.k.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    # O must not be touched between the two issues: rescaling it here makes ptxas
    # serialize every wgmma (C7513, "non wgmma instructions defining input registers").
    mbarrier.wait(smem.v_ready.index(prev), ((j - 1) // STAGES) & 1)
    o = warpgroup_mma(p, smem.v.index(prev), o, is_async=True)
    mbarrier.arrive(smem.turn.index(1 - WG))
    s = warpgroup_mma_wait(1, deps=(s, ))        # S_j done; P V_{j-1} may still run
    mbarrier.arrive(smem.k_empty.index(stage))
    p_new, alpha, m_i, l_i = _softmax(s, m_i, l_i, row0, j * BN, scale_log2, MASKED)
    o = warpgroup_mma_wait(0, deps=(o, ))        # P V_{j-1} done: V_{j-1} and P_{j-1} free
    mbarrier.arrive(smem.v_empty.index(prev))
    p = gl.convert_layout(p_new.to(p.dtype), p.type.layout)
    o = o * gl.expand_dims(alpha, 1)
    return p, o, m_i, l_i


@gluon.jit
def _consumer(smem, out_ptr, out_row0, stride_ot, q_len, q_first, num_tiles, scale_log2, WG: gl.constexpr,
              ctx=0, first_masked=0, PAGED: gl.constexpr = False):
    """One warpgroup: 64 query rows (query indices q_first + WG * 64 ..) over every tile.

    PAGED (launch_paged): query index i sits at key position ctx + i, tiles
    1 .. first_masked - 1 run unmasked and tiles max(first_masked, 1) .. num_tiles - 1
    (at most two: the diagonal may straddle a tile boundary) masked. Without PAGED
    (launch) ctx is 0 and only the last tile is masked, as before."""
    WM: gl.constexpr = smem.q.shape[1]
    D: gl.constexpr = smem.q.shape[2]
    BN: gl.constexpr = smem.k.shape[1]
    STAGES: gl.constexpr = smem.k.shape[0]
    gl.static_assert(BN == D, "S and O share one accumulator layout")
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, mma)

    row0 = q_first + WG * WM     # this warpgroup's first query index in the sequence
    if PAGED:
        row0 = row0 + ctx        # ... as a key position: the causal mask compares positions
    q_s = smem.q.index(WG)
    s_zero = gl.zeros([WM, BN], gl.float32, mma)
    mbarrier.wait(smem.q_ready.index(0), 0)

    # Event 0: S_0 alone. Tile 0 is the diagonal when num_tiles == 1; masking it always
    # costs one compare per score once per program.
    _wait_turn(smem, 0, WG)
    mbarrier.wait(smem.k_ready.index(0), 0)
    s = warpgroup_mma(q_s, smem.k.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    mbarrier.arrive(smem.turn.index(1 - WG))
    s = warpgroup_mma_wait(0, deps=(s, ))
    mbarrier.arrive(smem.k_empty.index(0))
    m_i = gl.full([WM], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([WM], gl.float32, row_layout)
    p, _, m_i, l_i = _softmax(s, m_i, l_i, row0, 0, scale_log2, True)     # O is still 0: no rescale
    p = gl.convert_layout(p.to(smem.q.dtype), p_layout)
    o = gl.zeros([WM, D], gl.float32, mma)

    if PAGED:
        # Events 1 .. num_tiles - 1: tiles wholly at or left of the block's first query
        # position unmasked, then the (one or two) tiles holding the diagonal masked.
        for j in range(1, first_masked):
            p, o, m_i, l_i = _step(smem, q_s, s_zero, p, o, m_i, l_i, j, j % STAGES, (j - 1) % STAGES, row0,
                                   scale_log2, WG, False)
        # At most two masked tiles follow (the block's 128 positions span two tiles at
        # most); straight-line steps rather than a loop keep P packed in the loop above.
        lo = gl.maximum(first_masked, 1)
        if lo < num_tiles:
            p, o, m_i, l_i = _step(smem, q_s, s_zero, p, o, m_i, l_i, lo, lo % STAGES, (lo - 1) % STAGES, row0,
                                   scale_log2, WG, True)
        if lo + 1 < num_tiles:
            hi = lo + 1
            p, o, m_i, l_i = _step(smem, q_s, s_zero, p, o, m_i, l_i, hi, hi % STAGES, (hi - 1) % STAGES, row0,
                                   scale_log2, WG, True)
    else:
        # Events 1 .. num_tiles - 1: full tiles unmasked, the last (diagonal) tile masked.
        for j in range(1, num_tiles - 1):
            p, o, m_i, l_i = _step(smem, q_s, s_zero, p, o, m_i, l_i, j, j % STAGES, (j - 1) % STAGES, row0,
                                   scale_log2, WG, False)
        if num_tiles > 1:
            last = num_tiles - 1
            p, o, m_i, l_i = _step(smem, q_s, s_zero, p, o, m_i, l_i, last, last % STAGES, (last - 1) % STAGES,
                                   row0, scale_log2, WG, True)

    # Event num_tiles: the last P V.
    last = (num_tiles - 1) % STAGES
    _wait_turn(smem, num_tiles, WG)
    mbarrier.wait(smem.v_ready.index(last), ((num_tiles - 1) // STAGES) & 1)
    o = warpgroup_mma(p, smem.v.index(last), o, is_async=True)
    mbarrier.arrive(smem.turn.index(1 - WG))
    o = warpgroup_mma_wait(0, deps=(o, ))
    mbarrier.arrive(smem.v_empty.index(last))

    o = o / gl.expand_dims(l_i, 1)
    # 16-byte stores: each thread writes 8 consecutive head-dim values of one row.
    store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    o = gl.convert_layout(o.to(out_ptr.dtype.element_ty), store_layout)
    offs_m = q_first + WG * WM + gl.arange(0, WM, layout=gl.SliceLayout(1, store_layout))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, store_layout))
    ptrs = out_ptr + gl.expand_dims((out_row0 + offs_m).to(gl.int64) * stride_ot, 1) + gl.expand_dims(offs_d, 0)
    gl.store(ptrs, o, mask=gl.expand_dims(offs_m < q_len, 1))


@gluon.jit(do_not_specialize=["num_m_blocks"])
def _prefill_ws_kernel(
    q_desc,             # TMA over q as [num_tokens, num_q_heads * D], [WG_M, D] tiles
    k_desc,             # TMA over k as [num_tokens, num_kv_heads * D], [BLOCK_N, D] tiles
    v_desc,             # same over v
    out_ptr,            # [num_tokens, num_q_heads, D] in q's dtype; head slice at + head * D
    cu_seqlens_ptr,     # [batch + 1] int32
    scale_log2,         # softmax scale * log2(e)
    stride_ot,          # out.stride(0); out.stride(1) == D, out.stride(2) == 1
    num_m_blocks,       # grid size along axis 1
    num_q_heads, queries_per_kv,
    NUM_STAGES: gl.constexpr,
):
    WM: gl.constexpr = q_desc.block_type.shape[0]
    D: gl.constexpr = q_desc.block_type.shape[1]
    BN: gl.constexpr = k_desc.block_type.shape[0]
    BM: gl.constexpr = 2 * WM

    # Same order as flash_prefill: heads of a sequence side by side (shared K/V in L2),
    # query tiles last-first so the longest causal rows start in the first wave.
    head = gl.program_id(0) % num_q_heads
    seq = gl.program_id(0) // num_q_heads
    m_block = num_m_blocks - 1 - gl.program_id(1)
    q_start = gl.load(cu_seqlens_ptr + seq)
    q_len = gl.load(cu_seqlens_ptr + seq + 1) - q_start
    q_first = m_block * BM
    if q_first >= q_len:
        return
    # Keys 0 .. min(q_first + BM, q_len) - 1: the last tile holds the diagonal.
    num_tiles = gl.cdiv(gl.minimum(q_first + BM, q_len), BN)
    kv_col = (head // queries_per_kv) * D

    smem = _Smem(
        gl.allocate_shared_memory(q_desc.dtype, [2, WM, D], q_desc.layout),
        gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES, BN, D], k_desc.layout),
        gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES, BN, D], v_desc.layout),
        gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()),
        gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout()),
        gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout()),
        gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout()),
        gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout()),
        gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout()),
    )
    mbarrier.init(smem.q_ready.index(0), count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(smem.k_ready.index(i), count=1)
        mbarrier.init(smem.v_ready.index(i), count=1)
        mbarrier.init(smem.k_empty.index(i), count=2)   # one arrival per consumer
        mbarrier.init(smem.v_empty.index(i), count=2)
    mbarrier.init(smem.turn.index(0), count=1)
    mbarrier.init(smem.turn.index(1), count=1)

    gl.warp_specialize([
        (_consumer, (smem, out_ptr + head * D, q_start, stride_ot, q_len, q_first, num_tiles, scale_log2, 0)),
        (_consumer, (smem, out_ptr + head * D, q_start, stride_ot, q_len, q_first, num_tiles, scale_log2, 1)),
        (_producer, (smem, q_desc, k_desc, v_desc, q_start + q_first, head * D, q_start, kv_col, num_tiles)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def _descriptor(x: torch.Tensor, block_rows: int) -> TensorDescriptor:
    """TMA over [num_tokens, num_heads, D] seen as 2-D rows of num_heads * D, loading
    [block_rows, D] tiles (one head's slice of block_rows consecutive tokens)."""
    num_tokens, num_heads, head_dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != head_dim or x.data_ptr() % 16 or (x.stride(0) * x.element_size()) % 16:
        x = x.contiguous()  # TMA needs 16-byte-aligned rows; a fused qkv view normally has them
    layout = gl.NVMMASharedLayout.get_default_for([block_rows, head_dim], _GL_DTYPES[x.dtype])
    return TensorDescriptor(x, [num_tokens, num_heads * head_dim], [x.stride(0), 1], [block_rows, head_dim], layout)


def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
           scale: float, out: torch.Tensor) -> None:
    """The kernel over checked arguments (see kernels.flash_prefill_ws)."""
    num_q_heads, num_kv_heads = q.shape[1], k.shape[1]
    batch = cu_seqlens.shape[0] - 1
    num_m_blocks = triton.cdiv(max_seqlen, BLOCK_M)
    _prefill_ws_kernel[(batch * num_q_heads, num_m_blocks)](
        _descriptor(q, WG_M), _descriptor(k, BLOCK_N), _descriptor(v, BLOCK_N), out, cu_seqlens,
        scale * LOG2E, out.stride(0), num_m_blocks, num_q_heads, num_q_heads // num_kv_heads,
        NUM_STAGES=NUM_STAGES, num_warps=4, maxnreg=MAXNREG,
    )


@gluon.jit(do_not_specialize=["num_m_blocks", "bt_stride"])
def _prefill_paged_kernel(
    q_desc,             # TMA over q as [num_tokens, num_q_heads * D], [WG_M, D] tiles
    k_desc,             # TMA over k_cache as [num_blocks * PAGE, num_kv_heads * D], [PAGE, D] boxes
    v_desc,             # same over v_cache
    out_ptr,            # [num_tokens, num_q_heads, D] in q's dtype; head slice at + head * D
    cu_seqlens_ptr,     # [batch + 1] int32 query offsets
    seq_lens_ptr,       # [batch] int32 keys per sequence (earlier context + new tokens)
    block_tables_ptr,   # [batch, max_blocks] int32, last dim contiguous
    bt_stride,          # block_tables.stride(0)
    scale_log2,         # softmax scale * log2(e)
    stride_ot,          # out.stride(0); out.stride(1) == D, out.stride(2) == 1
    num_m_blocks,       # grid size along axis 1
    num_q_heads, queries_per_kv,
    NUM_STAGES: gl.constexpr,
):
    WM: gl.constexpr = q_desc.block_type.shape[0]
    D: gl.constexpr = q_desc.block_type.shape[1]
    PAGE: gl.constexpr = k_desc.block_type.shape[0]
    BN: gl.constexpr = D                # key tile rows (the S and O accumulators share a layout)
    BM: gl.constexpr = 2 * WM
    gl.static_assert(BN % PAGE == 0, "a key tile is a whole number of cache blocks")

    head = gl.program_id(0) % num_q_heads
    seq = gl.program_id(0) // num_q_heads
    m_block = num_m_blocks - 1 - gl.program_id(1)
    q_start = gl.load(cu_seqlens_ptr + seq)
    q_len = gl.load(cu_seqlens_ptr + seq + 1) - q_start
    q_first = m_block * BM
    if q_first >= q_len:
        return
    seq_len = gl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len               # key position of query index 0
    first_pos = ctx + q_first           # the block's first query position
    # Keys 0 .. end - 1, tiles aligned at multiples of BN in key position. Tile j needs the
    # mask iff it holds a key past first_pos (then, for some row, past the diagonal);
    # every key < seq_len for rows in the sequence follows from causality.
    end = gl.minimum(first_pos + BM, seq_len)
    num_tiles = gl.cdiv(end, BN)
    first_masked = (first_pos + 1) // BN
    last_page = (end - 1) // PAGE
    kv_col = (head // queries_per_kv) * D

    smem = _Smem(
        gl.allocate_shared_memory(q_desc.dtype, [2, WM, D], q_desc.layout),
        gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES, BN, D], k_desc.layout),
        gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES, BN, D], v_desc.layout),
        gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()),
        gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout()),
        gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout()),
        gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout()),
        gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout()),
        gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout()),
    )
    mbarrier.init(smem.q_ready.index(0), count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(smem.k_ready.index(i), count=1)
        mbarrier.init(smem.v_ready.index(i), count=1)
        mbarrier.init(smem.k_empty.index(i), count=2)   # one arrival per consumer
        mbarrier.init(smem.v_empty.index(i), count=2)
    mbarrier.init(smem.turn.index(0), count=1)
    mbarrier.init(smem.turn.index(1), count=1)

    gl.warp_specialize([
        (_consumer, (smem, out_ptr + head * D, q_start, stride_ot, q_len, q_first, num_tiles, scale_log2, 0,
                     ctx, first_masked, True)),
        (_consumer, (smem, out_ptr + head * D, q_start, stride_ot, q_len, q_first, num_tiles, scale_log2, 1,
                     ctx, first_masked, True)),
        (_producer_paged, (smem, q_desc, k_desc, v_desc, q_start + q_first, head * D,
                           block_tables_ptr + seq * bt_stride, last_page, kv_col, num_tiles)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def _cache_descriptor(cache: torch.Tensor) -> TensorDescriptor:
    """TMA over a contiguous [num_blocks, block_size, num_kv_heads, D] cache seen as 2-D
    rows of num_kv_heads * D (one per token slot), loading one head's [block_size, D] box
    of one cache block."""
    num_blocks, block_size, num_heads, head_dim = cache.shape
    layout = gl.NVMMASharedLayout.get_default_for([block_size, head_dim], _GL_DTYPES[cache.dtype])
    # The ring slots are allocated with this layout as [BLOCK_N, D] buffers and row-sliced
    # per block: it must be the full tile's layout too.
    assert layout == gl.NVMMASharedLayout.get_default_for([BLOCK_N, head_dim], _GL_DTYPES[cache.dtype]), layout
    return TensorDescriptor(cache, [num_blocks * block_size, num_heads * head_dim], [num_heads * head_dim, 1],
                            [block_size, head_dim], layout)


def launch_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, max_seqlen_q: int,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """kernels.flash_prefill.flash_prefill's semantics (without k_new/v_new): causal
    attention of packed new query tokens over their sequences' K/V, every key position
    0 .. seq_lens[b] - 1 read from the paged cache (the new tokens' K/V must already be
    there). Hopper, head dim 128, bf16/fp16, block_size in {16, 32, 64, 128}, GQA. No host
    sync. Cache slots of allocated blocks past a sequence's end are read too (then masked)
    and must hold finite values (a zero-initialised cache does): a NaN there would reach
    the output through 0 * NaN in P V."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    assert head_dim == HEAD_DIM and q.dtype in _GL_DTYPES, (head_dim, q.dtype)
    assert k_cache.shape == v_cache.shape == (num_blocks, block_size, num_kv_heads, head_dim)
    assert k_cache.dtype == v_cache.dtype == q.dtype
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert block_size in (16, 32, 64, 128), block_size
    assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
    assert scale > 0, "the kernel folds the scale into a running max"
    assert cu_seqlens_q.dtype == seq_lens.dtype == block_tables.dtype == torch.int32
    assert block_tables.dim() == 2 and block_tables.stride(1) == 1, block_tables.stride()
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1 and out.stride(1) == head_dim
    batch = cu_seqlens_q.shape[0] - 1
    if num_tokens == 0 or max_seqlen_q == 0 or batch == 0:
        return out
    num_m_blocks = triton.cdiv(max_seqlen_q, BLOCK_M)
    _prefill_paged_kernel[(batch * num_q_heads, num_m_blocks)](
        _descriptor(q, WG_M), _cache_descriptor(k_cache), _cache_descriptor(v_cache), out, cu_seqlens_q,
        seq_lens, block_tables, block_tables.stride(0), scale * LOG2E, out.stride(0), num_m_blocks, num_q_heads,
        num_q_heads // num_kv_heads, NUM_STAGES=NUM_STAGES, num_warps=4, maxnreg=MAXNREG,
    )
    return out
