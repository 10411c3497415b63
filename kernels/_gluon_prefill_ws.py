"""The Gluon kernel behind kernels.flash_prefill_ws (which checks arguments and falls
back cleanly where Gluon, an experimental Triton dialect, is missing or has changed):
FA3-style causal prefill for Hopper (sm_90) over packed sequences' own K/V.

The kernel is persistent: the grid is min(work items, SMs), a work item being 128 query
rows of one (sequence, query head). Items with work (query tile starting inside its
sequence) are numbered heaviest first (query tiles last-first, then sequence, then head:
the heads of a sequence side by side, sharing its K/V in L2) and dealt statically in
boustrophedon order: program pid takes item n * nprog + pid in even rounds n and
n * nprog + nprog - 1 - pid in odd ones, so that the program with the heaviest item of
one round gets the lightest of the next. Numbering only items with work keeps ragged
batches balanced (dealing all batch x heads x m-block slots can hand a few programs all of
a long sequence's tiles: 4x slower for one 16k sequence among 32 short ones). All three
roles run the same scheduler (_next_item) on the same read-only cu_seqlens, so they see the
same items; the scan touches no barrier. Against one program per item (the first version)
on an H200: +18% at 1k, +7% at 4k, even at 8k, -2% at 16k (benchmarks/RESULTS.md).

Each program runs three roles over its items:

- a 1-warp producer loads each item's two Q halves into one of two Q buffers (double
  buffered: the next item's Q lands while the consumers finish the current one), then
  streams the item's 128-row K and V tiles into a NUM_STAGES-deep ring. The ring's
  stage/phase come from a tile counter carried across items, so the next item's K/V tiles
  load while the consumers finish the current item;
- two consumer warpgroups own 64 query rows each and walk the same K/V tiles, ping-ponging
  on the tensor cores through a pair of turn barriers whose event counter is also carried
  across items (both consumers process the same items in the same order).

launch_paged runs the same persistent kernel over the paged KV cache (flash_prefill's
semantics: every key 0 .. seq_len - 1 read from the cache, so prompts with earlier context,
chunked prefill and prefix-cache hits work): same scheduler (item validity from the query
lengths, cu_seqlens_q), Q slots, ring, barriers and counters; _producer_paged gathers each
128-row K/V tile as one TMA box per cache block (block ids clamped to the item's last
needed block, so a ready barrier always receives exactly one tile's bytes), and the
consumers run with PAGED: query i at key position ctx + i (ctx = seq_len - q_len), tiles
wholly left of the block's first query position unmasked, the one or two holding the
diagonal masked (see _consumer_item). With PAGED False every helper compiles to exactly the
contiguous kernel's code (the SASS of _prefill_ws_kernel is unchanged).

Barrier invariants (g: global tile index of this program, = tiles of earlier processed
items + j; it: processed-item counter; ev: global event index = g + it for an item's
event j, an item having events 0 .. num_tiles):
  q_ready[s] (count 1 + tx): producer expect+2 TMA per item using slot s = it % 2;
      consumers wait parity (it // 2) & 1.
  q_empty[s] (count 2): each consumer arrives once per item after its last S = Q K^T
      completed; producer waits parity ((it // 2) & 1) ^ 1 before reloading slot s.
  k_ready/v_ready[g % S] (count 1 + tx): producer expect+TMA per tile; consumers wait
      parity (g // S) & 1.
  k_empty/v_empty[g % S] (count 2): each consumer arrives once per tile; producer waits
      parity ((g // S) & 1) ^ 1.
  turn[w] (count 1): the other consumer arrives once per event; consumer w waits parity
      (ev & 1) ^ (1 - w) before issuing event ev's products.
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
BLOCK_M = 128       # query rows per work item: two consumer warpgroups of WG_M rows
WG_M = 64
BLOCK_N = 128       # key/value rows per tile
# Shared memory: Q 2 x 32 KB (double buffered across items) + 2 x (K 32 KB + V 32 KB) +
# the output's layout change (2 x 8 KB) + barriers = 213112 B of the 232448 B an SM gives one program.
NUM_STAGES = 2
# Registers per thread: the consumer worker asks for 240 (the default partition, the other
# consumer, gets what maxnreg leaves: 168 * 384 - 240 * 128 - 24 * 128 = 240 each).
CONSUMER_REGS = gl.constexpr(240)
PRODUCER_REGS = gl.constexpr(24)
MAXNREG = 168


@aggregate
class _Smem:
    """Shared-memory buffers and the barriers that hand them between the roles."""

    q: gl.shared_memory_descriptor        # [4, WG_M, HEAD_DIM]: Q slot s, half w at index 2 * s + w
    k: gl.shared_memory_descriptor        # [NUM_STAGES, BLOCK_N, HEAD_DIM]
    v: gl.shared_memory_descriptor        # [NUM_STAGES, BLOCK_N, HEAD_DIM]
    q_ready: gl.shared_memory_descriptor  # [2, 1]: both Q halves of slot s landed (count 1 + tx)
    q_empty: gl.shared_memory_descriptor  # [2, 1]: both consumers done with slot s (count 2)
    k_ready: gl.shared_memory_descriptor  # [NUM_STAGES, 1]: TMA bytes arrived (count 1 + tx)
    v_ready: gl.shared_memory_descriptor
    k_empty: gl.shared_memory_descriptor  # [NUM_STAGES, 1]: both consumers done (count 2)
    v_empty: gl.shared_memory_descriptor
    turn: gl.shared_memory_descriptor     # [2, 1]: turn[w] lets consumer w issue its products

    @gluon.constexpr_function
    def __init__(self, q, k, v, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, turn):
        self.q = q
        self.k = k
        self.v = v
        self.q_ready = q_ready
        self.q_empty = q_empty
        self.k_ready = k_ready
        self.v_ready = v_ready
        self.k_empty = k_empty
        self.v_empty = v_empty
        self.turn = turn


@gluon.jit
def _next_item(cu_seqlens_ptr, batch, num_q_heads, mb, seq, k, want, BM: gl.constexpr, BN: gl.constexpr,
               seq_lens_ptr=0, PAGED: gl.constexpr = False):
    """The scheduler, run identically by all three roles. Valid work items (query tile
    m_block of sequence seq starts inside the sequence; every head) are numbered in the
    order m_block last-first, then sequence, then head: groups (mb, seq) of num_q_heads
    items, a group valid iff mb * BM < len(seq). (mb, seq) is the scan cursor and k the
    number of valid items before its group. Scans forward to the group holding valid item
    number `want` (want >= k); returns whether it exists, the item (sequence start, length,
    first query index, head, number of K/V tiles) and the cursor left at its group.
    Item validity is always about query tiles (q_len from cu_seqlens). PAGED: query i
    sits at key position ctx + i (ctx = seq_lens[seq] - q_len), so the item's keys are
    0 .. min(ctx + q_first + BM, seq_len) - 1; the cursor's seq is the item's sequence,
    from which the roles reload seq_len themselves (one cached scalar load per item)."""
    found = want < k        # False: want >= k always
    q_start = k * 0
    q_len = k * 0
    go = mb >= 0
    while go:
        q_start = gl.load(cu_seqlens_ptr + seq)
        q_len = gl.load(cu_seqlens_ptr + seq + 1) - q_start
        cnt = (mb * BM < q_len).to(gl.int32) * num_q_heads
        found = want < k + cnt
        adv = 1 - found.to(gl.int32)
        k = k + cnt * adv
        nxt = seq + adv
        wrap = (nxt >= batch).to(gl.int32)
        seq = nxt - batch * wrap
        mb = mb - wrap
        go = (adv != 0) & (mb >= 0)
    q_first = mb * BM
    if PAGED:
        # seq is in [0, batch) also when nothing was found (the cursor wraps to 0).
        seq_len = gl.load(seq_lens_ptr + seq)
        num_tiles = gl.cdiv(gl.minimum(seq_len - q_len + q_first + BM, seq_len), BN)
    else:
        # Keys 0 .. min(q_first + BM, q_len) - 1: the last tile holds the diagonal.
        num_tiles = gl.cdiv(gl.minimum(q_first + BM, q_len), BN)
    return found, q_start, q_len, q_first, want - k, num_tiles, mb, seq, k


@gluon.jit
def _want(n, pid, nprog):
    """Item number of this program's n-th item: round n of nprog items, position pid,
    reversed in odd rounds. A bijection between (program, n) and item numbers."""
    return n * nprog + pid + (n & 1) * (nprog - 1 - 2 * pid)


@gluon.jit
def _load_q(smem, q_desc, it, row, head):
    """Producer: the it-th item's two Q halves (rows row .. row + 2 WM - 1) into slot it % 2,
    once both consumers have released it."""
    WM: gl.constexpr = q_desc.block_type.shape[0]
    D: gl.constexpr = q_desc.block_type.shape[1]
    qs = it % 2
    # A fresh barrier passes a wait on parity 1: the first use of each slot needs no release.
    mbarrier.wait(smem.q_empty.index(qs), ((it // 2) & 1) ^ 1)
    q_bar = smem.q_ready.index(qs)
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row, head * D], q_bar, smem.q.index(2 * qs))
    tma.async_copy_global_to_shared(q_desc, [row + WM, head * D], q_bar, smem.q.index(2 * qs + 1))


@gluon.jit
def _producer(smem, q_desc, k_desc, v_desc, cu_seqlens_ptr, pid, nprog, batch, num_q_heads, num_m_blocks,
              queries_per_kv):
    """1 warp: per item, Q into slot it % 2, then K_j and V_j for j < num_tiles into the ring
    at global tile index t + j."""
    STAGES: gl.constexpr = smem.k.shape[0]
    WM: gl.constexpr = q_desc.block_type.shape[0]
    D: gl.constexpr = q_desc.block_type.shape[1]
    BN: gl.constexpr = k_desc.block_type.shape[0]
    it = pid * 0    # items processed so far
    t = pid * 0     # K/V tiles loaded so far (global ring counter)
    found, q_start, q_len, q_first, head, num_tiles, mb, seq, k = _next_item(
        cu_seqlens_ptr, batch, num_q_heads, num_m_blocks - 1, pid * 0, pid * 0, _want(it, pid, nprog),
        2 * WM, BN)
    while found:
        _load_q(smem, q_desc, it, q_start + q_first, head)
        kv_col = (head // queries_per_kv) * D
        for j in range(num_tiles):
            g = t + j
            stage = g % STAGES
            phase = ((g // STAGES) & 1) ^ 1
            row = q_start + j * BN
            mbarrier.wait(smem.k_empty.index(stage), phase)
            mbarrier.expect(smem.k_ready.index(stage), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [row, kv_col], smem.k_ready.index(stage), smem.k.index(stage))
            mbarrier.wait(smem.v_empty.index(stage), phase)
            mbarrier.expect(smem.v_ready.index(stage), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [row, kv_col], smem.v_ready.index(stage), smem.v.index(stage))
        it += 1
        t += num_tiles
        found, q_start, q_len, q_first, head, num_tiles, mb, seq, k = _next_item(
            cu_seqlens_ptr, batch, num_q_heads, mb, seq, k, _want(it, pid, nprog), 2 * WM, BN)


@gluon.jit
def _producer_paged(smem, q_desc, k_desc, v_desc, cu_seqlens_ptr, seq_lens_ptr, block_tables_ptr, bt_stride, nprog,
                    batch, num_q_heads, last_m_block, queries_per_kv):
    """1 warp, launch_paged: as _producer (same items, same Q slots, same global tile
    counter t), but K_j / V_j come from the paged cache, each tile gathered as
    BLOCK_N // PAGE boxes of PAGE rows (one per cache block) into consecutive row slices
    of the ring slot. All boxes of a tile complete on the slot's one ready barrier, which
    expects the whole tile's bytes: every box is always issued, its page index clamped to
    last_page (the item's last needed block), so the bytes that land always equal the
    expectation (the barrier protocol is the contiguous one, byte for byte) and no
    block-table entry past the item's last block is read; keys of clamped duplicate pages
    lie past the diagonal and the consumers mask them."""
    STAGES: gl.constexpr = smem.k.shape[0]
    WM: gl.constexpr = q_desc.block_type.shape[0]
    D: gl.constexpr = q_desc.block_type.shape[1]
    BN: gl.constexpr = smem.k.shape[1]
    PAGE: gl.constexpr = k_desc.block_type.shape[0]
    PAGES: gl.constexpr = BN // PAGE
    gl.static_assert(PAGES <= 32, "one lane per block id")
    # Lane i holds the tile's i-th block id (one coalesced load per tile, issued before
    # the waits so its latency hides behind them); each box takes it out with a warp
    # reduction. Eight scalar loads in flight would not fit the producer's 24 registers.
    lanes: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    offs = gl.arange(0, 32, layout=lanes)
    # The program id read here, the count a kernel argument (not captured from the kernel
    # body, nor %nctaid, which LLVM hoists there): values computed before the partitions
    # split stay live in registers through all of them, and this one has 24.
    pid = gl.program_id(0)
    it = pid * 0    # items processed so far
    t = pid * 0     # K/V tiles loaded so far (global ring counter)
    found, q_start, q_len, q_first, head, num_tiles, mb, seq, k = _next_item(
        cu_seqlens_ptr, batch, num_q_heads, last_m_block, pid * 0, pid * 0, _want(it, pid, nprog),
        2 * WM, BN, seq_lens_ptr, True)
    while found:
        _load_q(smem, q_desc, it, q_start + q_first, head)
        kv_col = (head // queries_per_kv) * D
        seq_len = gl.load(seq_lens_ptr + seq)
        # The item's keys are 0 .. end - 1 (as in _next_item); its last block holds key end - 1.
        # Block-table entries as int32 offsets from block_tables_ptr (the sequence's first and
        # last needed entry: three registers with the lane index across the tile loop).
        bt_first = seq * bt_stride
        bt_last = bt_first + (gl.minimum(seq_len - q_len + q_first + 2 * WM, seq_len) - 1) // PAGE
        for j in range(num_tiles):
            g = t + j
            stage = g % STAGES
            phase = ((g // STAGES) & 1) ^ 1
            ids = gl.load(block_tables_ptr + gl.minimum(bt_first + j * PAGES + offs, bt_last), mask=offs < PAGES,
                          other=0)
            # K and V written out: the same steps as one helper spill in the producer's 24
            # registers (sm_90 SASS, block size 16).
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
        it += 1
        t += num_tiles
        found, q_start, q_len, q_first, head, num_tiles, mb, seq, k = _next_item(
            cu_seqlens_ptr, batch, num_q_heads, mb, seq, k, _want(it, pid, nprog), 2 * WM, BN, seq_lens_ptr, True)


@gluon.jit
def _wait_turn(smem, event, WG: gl.constexpr):
    """Block until the other consumer has issued its products for the previous event:
    consumer 0's event e needs e arrivals of consumer 1 (parity trick: a fresh barrier
    passes parity 1), consumer 1's event e needs e + 1 arrivals of consumer 0. `event` is
    the program-wide event counter (carried across items)."""
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
def _step(smem, q_s, s_zero, p, o, m_i, l_i, g, event, col0, row0, scale_log2, WG: gl.constexpr,
          MASKED: gl.constexpr):
    """Global tile g (not an item's first): issue S_g = Q K_g^T and O += P_{g-1} V_{g-1}, then
    do tile g's softmax while the second product runs. `event` = g + items before this one;
    col0 = the tile's first key index in the sequence."""
    STAGES: gl.constexpr = smem.k.shape[0]
    stage = g % STAGES
    prev = (g - 1) % STAGES
    _wait_turn(smem, event, WG)
    mbarrier.wait(smem.k_ready.index(stage), (g // STAGES) & 1)
    s = warpgroup_mma(q_s, smem.k.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    # O must not be touched between the two issues (C7513 serializes every wgmma otherwise).
    mbarrier.wait(smem.v_ready.index(prev), ((g - 1) // STAGES) & 1)
    o = warpgroup_mma(p, smem.v.index(prev), o, is_async=True)
    mbarrier.arrive(smem.turn.index(1 - WG))
    s = warpgroup_mma_wait(1, deps=(s, ))        # S_g done; P V_{g-1} may still run
    mbarrier.arrive(smem.k_empty.index(stage))
    p_new, alpha, m_i, l_i = _softmax(s, m_i, l_i, row0, col0, scale_log2, MASKED)
    o = warpgroup_mma_wait(0, deps=(o, ))        # P V_{g-1} done: V_{g-1} and P_{g-1} free
    mbarrier.arrive(smem.v_empty.index(prev))
    p = gl.convert_layout(p_new.to(p.dtype), p.type.layout)
    o = o * gl.expand_dims(alpha, 1)
    return p, o, m_i, l_i


@gluon.jit
def _consumer_item(smem, out_ptr, stride_ot, q_start, q_len, q_first, head, num_tiles, it, t, scale_log2,
                   cu_seqlens_ptr, pid, nprog, batch, num_q_heads, mb, seq, k, WG: gl.constexpr,
                   seq_lens_ptr=0, PAGED: gl.constexpr = False):
    """One item for one warpgroup: 64 query rows (query indices q_first + WG * 64 ..) over
    the item's tiles, which are the program's global tiles t .. t + num_tiles - 1; the item's
    events 0 .. num_tiles are global events t + it .. t + it + num_tiles. Also runs the
    scheduler for the next item (in the shadow of the last P V) and returns its result.

    PAGED (launch_paged): query index i sits at key position ctx + i (ctx = seq_len -
    q_len); with P = ctx + q_first, tiles 1 .. first_masked - 1 (first_masked =
    (P + 1) // BN: tiles whose keys are all <= P) run unmasked, tiles
    max(first_masked, 1) .. num_tiles - 1 (at most two: the block's 128 positions span
    two tiles at most) masked; tile 0 is always masked (event 0). The steps still cover
    tiles 1 .. num_tiles - 1 in order (first_masked <= num_tiles), so the barrier and
    event sequence is the contiguous one."""
    WM: gl.constexpr = smem.q.shape[1]
    D: gl.constexpr = smem.q.shape[2]
    BN: gl.constexpr = smem.k.shape[1]
    STAGES: gl.constexpr = smem.k.shape[0]
    gl.static_assert(BN == D, "S and O share one accumulator layout")
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, mma)

    row0 = q_first + WG * WM
    if PAGED:
        ctx = gl.load(seq_lens_ptr + seq) - q_len
        first_masked = (ctx + q_first + 1) // BN
        row0 = row0 + ctx        # ... as a key position: the causal mask compares positions
    qs = it % 2
    q_s = smem.q.index(2 * qs + WG)
    s_zero = gl.zeros([WM, BN], gl.float32, mma)
    mbarrier.wait(smem.q_ready.index(qs), (it // 2) & 1)

    # Event 0 (global t + it): S of the item's first tile alone, masked (the diagonal when
    # num_tiles == 1).
    stage0 = t % STAGES
    _wait_turn(smem, t + it, WG)
    mbarrier.wait(smem.k_ready.index(stage0), (t // STAGES) & 1)
    s = warpgroup_mma(q_s, smem.k.index(stage0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    mbarrier.arrive(smem.turn.index(1 - WG))
    s = warpgroup_mma_wait(0, deps=(s, ))
    mbarrier.arrive(smem.k_empty.index(stage0))
    m_i = gl.full([WM], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([WM], gl.float32, row_layout)
    p, _, m_i, l_i = _softmax(s, m_i, l_i, row0, 0, scale_log2, True)     # O is still 0: no rescale
    p = gl.convert_layout(p.to(smem.q.dtype), p_layout)
    o = gl.zeros([WM, D], gl.float32, mma)

    if PAGED:
        # Events 1 .. num_tiles - 1: tiles wholly at or left of the block's first query
        # position unmasked, then the (one or two) tiles holding the diagonal masked;
        # straight-line steps rather than a loop keep P packed in the loop above.
        for j in range(1, first_masked):
            p, o, m_i, l_i = _step(smem, q_s, s_zero, p, o, m_i, l_i, t + j, t + j + it, j * BN, row0, scale_log2,
                                   WG, False)
        lo = gl.maximum(first_masked, 1)
        if lo < num_tiles:
            p, o, m_i, l_i = _step(smem, q_s, s_zero, p, o, m_i, l_i, t + lo, t + lo + it, lo * BN, row0,
                                   scale_log2, WG, True)
        if lo + 1 < num_tiles:
            hi = lo + 1
            p, o, m_i, l_i = _step(smem, q_s, s_zero, p, o, m_i, l_i, t + hi, t + hi + it, hi * BN, row0,
                                   scale_log2, WG, True)
    else:
        # Events 1 .. num_tiles - 1: full tiles unmasked, the last (diagonal) tile masked.
        for j in range(1, num_tiles - 1):
            p, o, m_i, l_i = _step(smem, q_s, s_zero, p, o, m_i, l_i, t + j, t + j + it, j * BN, row0, scale_log2,
                                   WG, False)
        if num_tiles > 1:
            last = num_tiles - 1
            p, o, m_i, l_i = _step(smem, q_s, s_zero, p, o, m_i, l_i, t + last, t + last + it, last * BN, row0,
                                   scale_log2, WG, True)
    last = num_tiles - 1
    # Every S = Q K^T of this item has completed (waited above): release the Q slot.
    mbarrier.arrive(smem.q_empty.index(qs))

    # Event num_tiles: the last P V.
    g_last = t + last
    stage_last = g_last % STAGES
    _wait_turn(smem, t + it + num_tiles, WG)
    mbarrier.wait(smem.v_ready.index(stage_last), (g_last // STAGES) & 1)
    o = warpgroup_mma(p, smem.v.index(stage_last), o, is_async=True)
    mbarrier.arrive(smem.turn.index(1 - WG))
    # The next item, found while the last P V runs (no barrier traffic, registers only).
    nxt = _next_item(cu_seqlens_ptr, batch, num_q_heads, mb, seq, k, _want(it + 1, pid, nprog), 2 * WM, BN,
                     seq_lens_ptr, PAGED)
    o = warpgroup_mma_wait(0, deps=(o, ))
    mbarrier.arrive(smem.v_empty.index(stage_last))

    o = o / gl.expand_dims(l_i, 1)
    # 16-byte stores: each thread writes 8 consecutive head-dim values of one row.
    store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    o = gl.convert_layout(o.to(out_ptr.dtype.element_ty), store_layout)
    offs_m = q_first + WG * WM + gl.arange(0, WM, layout=gl.SliceLayout(1, store_layout))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, store_layout))
    ptrs = (out_ptr + head * D + gl.expand_dims((q_start + offs_m).to(gl.int64) * stride_ot, 1) +
            gl.expand_dims(offs_d, 0))
    gl.store(ptrs, o, mask=gl.expand_dims(offs_m < q_len, 1))
    return nxt


@gluon.jit
def _consumer(smem, out_ptr, stride_ot, cu_seqlens_ptr, pid, nprog, batch, num_q_heads, num_m_blocks, scale_log2,
              WG: gl.constexpr, seq_lens_ptr=0, PAGED: gl.constexpr = False):
    """One warpgroup over the program's items, carrying the item and tile counters."""
    WM: gl.constexpr = smem.q.shape[1]
    BN: gl.constexpr = smem.k.shape[1]
    if PAGED:
        # launch_paged passes the last m-block (not num_m_blocks), the grid size, and no
        # program id (read here): values the kernel body computes stay live through every
        # partition, the producer's 24 registers included.
        mb0 = num_m_blocks
        pid = gl.program_id(0)
    else:
        mb0 = num_m_blocks - 1
    it = pid * 0
    t = pid * 0
    found, q_start, q_len, q_first, head, num_tiles, mb, seq, k = _next_item(
        cu_seqlens_ptr, batch, num_q_heads, mb0, pid * 0, pid * 0, _want(it, pid, nprog),
        2 * WM, BN, seq_lens_ptr, PAGED)
    while found:
        t_next = t + num_tiles
        found, q_start, q_len, q_first, head, num_tiles, mb, seq, k = _consumer_item(
            smem, out_ptr, stride_ot, q_start, q_len, q_first, head, num_tiles, it, t, scale_log2, cu_seqlens_ptr, pid,
            nprog, batch, num_q_heads, mb, seq, k, WG, seq_lens_ptr, PAGED)
        it += 1
        t = t_next


@gluon.jit
def _init_smem(q_desc, k_desc, v_desc, NUM_STAGES: gl.constexpr):
    """The buffers and barriers of _Smem, allocated and initialised (both kernels)."""
    WM: gl.constexpr = q_desc.block_type.shape[0]
    D: gl.constexpr = q_desc.block_type.shape[1]
    BN: gl.constexpr = D                # key tile rows (the S and O accumulators share a layout)
    smem = _Smem(
        gl.allocate_shared_memory(q_desc.dtype, [4, WM, D], q_desc.layout),
        gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES, BN, D], k_desc.layout),
        gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES, BN, D], v_desc.layout),
        gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout()),
        gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout()),
        gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout()),
        gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout()),
        gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout()),
        gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout()),
        gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout()),
    )
    for i in gl.static_range(2):
        mbarrier.init(smem.q_ready.index(i), count=1)
        mbarrier.init(smem.q_empty.index(i), count=2)    # one arrival per consumer
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(smem.k_ready.index(i), count=1)
        mbarrier.init(smem.v_ready.index(i), count=1)
        mbarrier.init(smem.k_empty.index(i), count=2)   # one arrival per consumer
        mbarrier.init(smem.v_empty.index(i), count=2)
    mbarrier.init(smem.turn.index(0), count=1)
    mbarrier.init(smem.turn.index(1), count=1)
    return smem


@gluon.jit(do_not_specialize=["batch", "num_m_blocks", "num_q_heads", "queries_per_kv"])
def _prefill_ws_kernel(
    q_desc,             # TMA over q as [num_tokens, num_q_heads * D], [WG_M, D] tiles
    k_desc,             # TMA over k as [num_tokens, num_kv_heads * D], [BLOCK_N, D] tiles
    v_desc,             # same over v
    out_ptr,            # [num_tokens, num_q_heads, D] in q's dtype; head slice at + head * D
    cu_seqlens_ptr,     # [batch + 1] int32
    scale_log2,         # softmax scale * log2(e)
    stride_ot,          # out.stride(0); out.stride(1) == D, out.stride(2) == 1
    batch,              # number of sequences
    num_m_blocks,       # cdiv(max_seqlen, BLOCK_M)
    num_q_heads, queries_per_kv,
    NUM_STAGES: gl.constexpr,
):
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)

    smem = _init_smem(q_desc, k_desc, v_desc, NUM_STAGES)

    gl.warp_specialize([
        (_consumer, (smem, out_ptr, stride_ot, cu_seqlens_ptr, pid, nprog, batch, num_q_heads, num_m_blocks,
                     scale_log2, 0)),
        (_consumer, (smem, out_ptr, stride_ot, cu_seqlens_ptr, pid, nprog, batch, num_q_heads, num_m_blocks,
                     scale_log2, 1)),
        (_producer, (smem, q_desc, k_desc, v_desc, cu_seqlens_ptr, pid, nprog, batch, num_q_heads, num_m_blocks,
                     queries_per_kv)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
BLOCK_SIZES = (16, 32, 64, 128)     # cache block sizes launch_paged gathers (a K/V tile is whole blocks)


def _grid(q: torch.Tensor, batch: int, max_seqlen_q: int, max_programs: int | None) -> tuple[int]:
    """One program per SM (or max_programs), never more than there are work items: at most
    batch * heads * m-blocks items have work (fewer where sequences are shorter than
    max_seqlen_q: a program left without items exits after one scan of cu_seqlens)."""
    programs = torch.cuda.get_device_properties(q.device).multi_processor_count
    if max_programs is not None:
        programs = min(programs, max_programs)
    return (min(batch * q.shape[1] * triton.cdiv(max_seqlen_q, BLOCK_M), programs), )


def _descriptor(x: torch.Tensor, block_rows: int) -> TensorDescriptor:
    """TMA over [num_tokens, num_heads, D] seen as 2-D rows of num_heads * D, loading
    [block_rows, D] tiles (one head's slice of block_rows consecutive tokens)."""
    num_tokens, num_heads, head_dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != head_dim or x.data_ptr() % 16 or (x.stride(0) * x.element_size()) % 16:
        x = x.contiguous()  # TMA needs 16-byte-aligned rows; a fused qkv view normally has them
    layout = gl.NVMMASharedLayout.get_default_for([block_rows, head_dim], _GL_DTYPES[x.dtype])
    return TensorDescriptor(x, [num_tokens, num_heads * head_dim], [x.stride(0), 1], [block_rows, head_dim], layout)


def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
           scale: float, out: torch.Tensor, max_programs: int | None) -> None:
    """The contiguous kernel over checked arguments (see kernels.flash_prefill_ws)."""
    num_q_heads, num_kv_heads = q.shape[1], k.shape[1]
    batch = cu_seqlens.shape[0] - 1
    grid = _grid(q, batch, max_seqlen, max_programs)
    _prefill_ws_kernel[grid](
        _descriptor(q, WG_M), _descriptor(k, BLOCK_N), _descriptor(v, BLOCK_N), out, cu_seqlens,
        scale * LOG2E, out.stride(0), batch, triton.cdiv(max_seqlen, BLOCK_M), num_q_heads,
        num_q_heads // num_kv_heads, NUM_STAGES=NUM_STAGES, num_warps=4, maxnreg=MAXNREG,
    )


@gluon.jit(do_not_specialize=["batch", "last_m_block", "num_q_heads", "queries_per_kv", "bt_stride", "nprog"])
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
    batch,              # number of sequences
    last_m_block,       # cdiv(max_seqlen_q, BLOCK_M) - 1
    num_q_heads, queries_per_kv,
    nprog,              # the grid size
    NUM_STAGES: gl.constexpr,
):
    """_prefill_ws_kernel over the paged KV cache: same persistent scheduler, Q slots,
    ring and barriers; _producer_paged gathers the tiles, the consumers run PAGED."""
    gl.static_assert(q_desc.block_type.shape[1] % k_desc.block_type.shape[0] == 0,
                     "a key tile (D rows) is a whole number of cache blocks")
    pid = 0     # the consumers read their program id themselves (see _consumer)

    smem = _init_smem(q_desc, k_desc, v_desc, NUM_STAGES)

    gl.warp_specialize([
        (_consumer, (smem, out_ptr, stride_ot, cu_seqlens_ptr, pid, nprog, batch, num_q_heads, last_m_block,
                     scale_log2, 0, seq_lens_ptr, True)),
        (_consumer, (smem, out_ptr, stride_ot, cu_seqlens_ptr, pid, nprog, batch, num_q_heads, last_m_block,
                     scale_log2, 1, seq_lens_ptr, True)),
        (_producer_paged, (smem, q_desc, k_desc, v_desc, cu_seqlens_ptr, seq_lens_ptr, block_tables_ptr, bt_stride,
                           nprog, batch, num_q_heads, last_m_block, queries_per_kv)),
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
                 out: torch.Tensor, max_programs: int | None) -> None:
    """The paged kernel over checked arguments (see kernels.flash_prefill_ws_paged)."""
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    batch = cu_seqlens_q.shape[0] - 1
    grid = _grid(q, batch, max_seqlen_q, max_programs)
    _prefill_paged_kernel[grid](
        _descriptor(q, WG_M), _cache_descriptor(k_cache), _cache_descriptor(v_cache), out, cu_seqlens_q,
        seq_lens, block_tables, block_tables.stride(0), scale * LOG2E, out.stride(0), batch,
        triton.cdiv(max_seqlen_q, BLOCK_M) - 1, num_q_heads, num_q_heads // num_kv_heads, grid[0],
        NUM_STAGES=NUM_STAGES, num_warps=4, maxnreg=MAXNREG,
    )
