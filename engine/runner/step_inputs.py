"""One builder of step inputs: a scheduled batch -> the tensors the model and the
attention backend read, for eager steps and CUDA-graph replays alike.

The tensors are views of persistent buffers, so a graph captured over them replays any
later batch of its size. On CUDA a step costs two host-to-device copies (every int64
input in one, every int32 one in the other, each of only what the step uses) from pinned
staging, and nothing else unless tokens are in flight (one gather). Each sequence's block
table is mirrored on the host and only blocks added since its last step are written: a
sequence's `block_ids` only grow between bumps of `Sequence.block_table_version` (the
block manager bumps it when it frees or trims them), so a 256 x 1.5k decode step writes
~16 block ids, not 24,000.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from pdserve.engine.attention import AttentionMetadata
from pdserve.engine.sequence import PLACEHOLDER_TOKEN_ID, Sequence


@dataclass(slots=True)
class StepInputs:
    """One step's inputs: decodes (one token after context) first, then prefill chunks."""

    input_ids: torch.Tensor  # [num_tokens] int64 (graph steps: padded to the bucket)
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_logits] int64: rows of the hidden states to compute logits for
    # (seq, first logits row, rows): after its last token, then after each proposed token.
    spans: list[tuple[Sequence, int, int]]


@dataclass(slots=True)
class InFlightTokens:
    """Tokens the host does not know yet, on the device: a sequence whose last token was
    sampled by a step that may still be running, or whose proposals a drafter made there
    (still `PLACEHOLDER_TOKEN_ID` on the host), reads them from `token_ids`."""

    token_ids: torch.Tensor  # [N] int64, on the device
    # Each sequence's row of token_ids: its last token's, or its proposals' first (they take
    # that row and on; the rows after its last token's when both are in flight).
    rows: dict[Sequence, int]


@dataclass(slots=True)
class _Gathered:
    """What the per-sequence pass of `StepInputBuilder.build` collects."""

    rows: np.ndarray  # [n] each sequence's block-table row
    starts: np.ndarray  # [n] its first new token's position
    counts: np.ndarray  # [n] its new tokens
    ids: list[int] = field(default_factory=list)
    logits_rows: list[int] = field(default_factory=list)
    spans: list[tuple[Sequence, int, int]] = field(default_factory=list)
    carried_to: list[int] = field(default_factory=list)  # token indices whose id is in flight
    carried_from: list[int] = field(default_factory=list)  # ... and its row of InFlightTokens.token_ids
    num_decodes: int = 0
    width: int = 1  # blocks of the longest block table


class StepInputBuilder:
    """Builds `StepInputs` into fixed buffers sized for `max_num_tokens` tokens of at most
    `max_num_seqs` sequences (a larger batch raises: the scheduler's budget bounds it),
    each of at most `max_blocks_per_seq` blocks.

    A step's inputs are packed at the front of two buffers, so that one copy of each brings
    only what the step uses: int64 [ids | positions | slots | logits rows | in-flight
    tokens' destinations | their sources], int32 [seq lens | prefill cu_seqlens | block
    table, n x width]. A graph's step (bucket B of q tokens each, table `width` wide) has a
    fixed layout of its own: B * q ids, positions and slots, B seq lens, B + 1 cu_seqlens
    when q > 1, the table; the graph reads the table where it lands, with no copy after."""

    def __init__(self, block_size: int, max_blocks_per_seq: int, max_num_tokens: int, max_num_seqs: int,
                 device: torch.device, growable: bool = False) -> None:
        """growable: a larger batch reallocates the buffers instead of raising (for a runner
        without graphs whose batches the scheduler does not bound, such as a draft model's)."""
        self.block_size = block_size
        self.max_blocks = max_blocks_per_seq
        self.device = device
        self.growable = growable
        self._rows = _BlockTableRows(max_blocks_per_seq)
        self._allocate(max_num_tokens, max_num_seqs)

    def _allocate(self, max_num_tokens: int, max_num_seqs: int) -> None:
        self.max_tokens, self.max_seqs = max_num_tokens, max_num_seqs
        on_gpu = self.device.type == "cuda"
        n64, n32 = 6 * max_num_tokens, 2 * max_num_seqs + 1 + max_num_seqs * self.max_blocks
        # Two staging sets, alternated, so that a step's host writes never race the copies
        # of the step before, which may still be in flight.
        self._staging = [(torch.zeros(n64, dtype=torch.int64, pin_memory=on_gpu),
                          torch.zeros(n32, dtype=torch.int32, pin_memory=on_gpu)) for _ in range(2 if on_gpu else 1)]
        self._staging_np = [(h64.numpy(), h32.numpy()) for h64, h32 in self._staging]
        self._copied: list[torch.cuda.Event | None] = [None] * len(self._staging)
        self._turn = 0
        if on_gpu:
            self._dev64 = torch.zeros(n64, dtype=torch.int64, device=self.device)
            self._dev32 = torch.zeros(n32, dtype=torch.int32, device=self.device)
        else:  # the CPU reads the staging directly
            self._dev64, self._dev32 = self._staging[0]
        self._graph_views: dict[tuple[int, int, int], StepInputs] = {}
        # The graph layout (bucket, width, q) the buffers hold whole, None after an eager step:
        # a graph replayed over another layout reads that one's slots as its token ids (issue
        # 53: past the vocabulary, a device-side assert that ends the process).
        self.graph_layout: tuple[int, int, int] | None = None

    # Graphs -------------------------------------------------------------

    def graph_inputs(self, bucket: int, width: int, tokens_per_seq: int = 1) -> StepInputs:
        """The views a CUDA graph of `bucket` sequences of `tokens_per_seq` new tokens each is
        captured over, its block table `width` blocks wide; `build(..., graph=(bucket,
        width))` fills them before each replay. Starts as padding (no slot written, nothing
        attended)."""
        q = tokens_per_seq
        views = self._views(bucket, width, q)
        # Graphs' layouts overlap (one's slots may be another's ids): all of it set.
        views.input_ids.zero_()
        views.positions.zero_()
        views.meta.slot_mapping.fill_(-1)
        self._dev32[:bucket].zero_()
        if q > 1:
            views.meta.prefill_cu_seqlens_q.copy_(torch.arange(0, (bucket + 1) * q, q, dtype=torch.int32))
        self.graph_layout = (bucket, width, q)
        return views

    def check_graph_layout(self, bucket: int, width: int, tokens_per_seq: int) -> None:
        """Raises unless the buffers hold the layout of that graph whole (the last build was
        `build(..., graph=(bucket, width))` of that q, or its `graph_inputs`): what a replay
        of the graph may read."""
        if self.graph_layout != (bucket, width, tokens_per_seq):
            raise ValueError(f"the step inputs hold {self.graph_layout or 'an eager step'}, not the layout of the "
                             f"graph (bucket, width, q) = {(bucket, width, tokens_per_seq)}: build its inputs first")

    # Building -----------------------------------------------------------

    def build(self, seqs: list[Sequence], num_new_tokens: list[int], in_flight: InFlightTokens | None = None,
              graph: tuple[int, int] | None = None) -> StepInputs:
        """Inputs for `seqs[i]` advancing by `num_new_tokens[i]` (decodes first; a sequence's
        tokens past `num_tokens` are its proposals, `spec_token_ids`).

        in_flight: where the last tokens still unknown on the host are (see InFlightTokens).
        graph: (bucket, width) of the CUDA graph that replays a uniform batch (every
            sequence's `num_new_tokens` the same q, reaching its end): inputs go into the
            views of `graph_inputs(bucket, width, q)`, padded sequences write and attend
            to nothing.
        """
        n, num_tokens = len(seqs), sum(num_new_tokens)
        if (num_tokens > self.max_tokens or n > self.max_seqs) and self.growable:
            self._allocate(max(num_tokens, 2 * self.max_tokens), max(n, 2 * self.max_seqs))
        if num_tokens > self.max_tokens or n > self.max_seqs:
            raise ValueError(f"a step of {num_tokens} tokens over {n} sequences exceeds the input buffers "
                             f"({self.max_tokens} tokens, {self.max_seqs} sequences)")
        g = self._gather(seqs, num_new_tokens, in_flight)
        if graph is not None:
            return self._build_graph(g, n, num_new_tokens[0], *graph, in_flight)
        self.graph_layout = None
        seq_lens = g.starts + g.counts
        # Token j of sequence i sits at position starts[i] + j.
        token_seq = np.repeat(np.arange(n), g.counts)
        first_token = np.cumsum(g.counts) - g.counts
        positions = g.starts[token_seq] + (np.arange(num_tokens) - first_token[token_seq])
        slots = self._slots(g.rows[token_seq], positions)
        nd = g.num_decodes
        prefill_q_lens = g.counts[nd:]
        width = g.width

        staging = self._next_staging()
        h64, h32 = staging[2], staging[3]
        t, num_logits = num_tokens, len(g.logits_rows)
        h64[:t] = g.ids
        h64[t:2 * t] = positions
        h64[2 * t:3 * t] = slots
        h64[3 * t:3 * t + num_logits] = g.logits_rows
        h32[:n] = seq_lens
        h32[n] = 0
        h32[n + 1:2 * n - nd + 1] = np.cumsum(prefill_q_lens)
        table_at = 2 * n - nd + 1
        self._finish_staging(g, staging, 3 * t + num_logits, table_at, width, t, in_flight)

        d64, d32 = self._dev64, self._dev32
        tables = d32[table_at:table_at + n * width].view(n, width)
        return StepInputs(
            input_ids=d64[:t],
            positions=d64[t:2 * t],
            meta=AttentionMetadata(
                slot_mapping=d64[2 * t:3 * t],
                num_decodes=nd,
                decode_block_tables=tables[:nd],
                decode_seq_lens=d32[:nd],
                prefill_cu_seqlens_q=d32[n:2 * n - nd + 1],
                prefill_seq_lens=d32[nd:n],
                prefill_block_tables=tables[nd:],
                prefill_max_seqlen_q=int(prefill_q_lens.max(initial=0)),
                decode_seq_lens_host=seq_lens[:nd].tolist(),
                prefill_q_lens_host=prefill_q_lens.tolist(),
                prefill_seq_lens_host=seq_lens[nd:].tolist(),
                decode_table_ids=tuple(self._rows.table_ids[g.rows[:nd]].tolist()),
            ),
            logits_indices=d64[3 * t:3 * t + num_logits],
            spans=g.spans,
        )

    def _build_graph(self, g: _Gathered, n: int, q: int, bucket: int, width: int,
                     in_flight: InFlightTokens | None) -> StepInputs:
        """`build` for a graph's uniform step: every region of its layout written (padding
        included: other steps share the buffers), no per-token arrays but the three the
        graph reads."""
        num_tokens, padded = n * q, bucket * q
        assert width >= g.width, f"a graph's block table of {width} blocks cannot hold a sequence of {g.width}"
        positions = g.starts[:, None] + np.arange(q)
        slots = self._slots(g.rows[:, None], positions)
        staging = self._next_staging()
        h64, h32 = staging[2], staging[3]
        h64[:num_tokens] = g.ids
        h64[num_tokens:padded] = 0
        h64[padded:padded + num_tokens] = positions.ravel()
        h64[padded + num_tokens:2 * padded] = 0
        h64[2 * padded:2 * padded + num_tokens] = slots.ravel()
        h64[2 * padded + num_tokens:3 * padded] = -1
        h32[:n] = g.starts + q
        h32[n:bucket + 1] = 0  # padding's lens; at q = 1 also the (empty) prefills' cu_seqlens
        table_at = bucket + 1
        if q > 1:  # every sequence, padding too, has q tokens
            h32[bucket:2 * bucket + 1] = np.arange(0, (bucket + 1) * q, q)
            table_at = 2 * bucket + 1
        self._finish_staging(g, staging, 3 * padded, table_at, width, padded, in_flight)
        views = self._views(bucket, width, q)
        self.graph_layout = (bucket, width, q)
        # A graph's logits cover every token: a span starts at its first token's row.
        # (A draft's catch-up of q known tokens has logits after the last one only.)
        spans = [(seq, q * i + q - count, count) for i, (seq, _, count) in enumerate(g.spans)]
        return StepInputs(views.input_ids, views.positions, views.meta, views.logits_indices, spans)

    def _slots(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The KV slot of each position of the sequences in those block-table rows."""
        bs = self.block_size
        return self._rows.table[rows, positions // bs].astype(np.int64) * bs + positions % bs

    def _finish_staging(self, g: _Gathered, staging: tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray],
                        carry_at: int, table_at: int, width: int, num_ids: int,
                        in_flight: InFlightTokens | None) -> None:
        """What both layouts end with: the in-flight tokens' destinations and sources staged at
        `carry_at`, the block table (n x width) at `table_at`; both buffers uploaded; then, on
        the device, the tokens in flight gathered into the step's first `num_ids` ids."""
        host64, host32, h64, h32 = staging
        num_carried, n = len(g.carried_to), len(g.rows)
        h64[carry_at:carry_at + num_carried] = g.carried_to
        h64[carry_at + num_carried:carry_at + 2 * num_carried] = g.carried_from
        h32[table_at:table_at + n * width].reshape(n, width)[:] = self._rows.table[g.rows, :width]
        self._upload(host64, host32, carry_at + 2 * num_carried, table_at + n * width)
        if num_carried:
            assert in_flight is not None
            d64 = self._dev64
            d64[:num_ids].index_copy_(0, d64[carry_at:carry_at + num_carried], in_flight.token_ids.index_select(
                0, d64[carry_at + num_carried:carry_at + 2 * num_carried]))

    def _gather(self, seqs: list[Sequence], num_new_tokens: list[int], in_flight: InFlightTokens | None) -> _Gathered:
        """The per-sequence pass: block-table rows brought up to date, token ids, logits rows."""
        g = _Gathered(rows=np.empty(len(seqs), dtype=np.int64), starts=np.empty(len(seqs), dtype=np.int64),
                      counts=np.asarray(num_new_tokens, dtype=np.int64))
        ids, logits_rows = g.ids, g.logits_rows
        for i, (seq, k) in enumerate(zip(seqs, num_new_tokens)):
            g.rows[i] = self._rows.update(seq)
            start = seq.num_computed_tokens
            g.starts[i] = start
            end = start + k
            last = len(seq.token_ids)
            carried = seq.token_ids[last - 1] == PLACEHOLDER_TOKEN_ID
            if carried:
                assert in_flight is not None and start == last - 1, "an unknown token can only be a decode's input"
                g.carried_to.append(len(ids))
                g.carried_from.append(in_flight.rows[seq])
            ids.extend(seq.token_ids[start:end])
            if end >= last:  # reaches the end: logits after the last token and each proposal kept
                num_proposed = end - last
                ids.extend(seq.spec_token_ids[:num_proposed])
                if num_proposed and seq.spec_token_ids[0] == PLACEHOLDER_TOKEN_ID:  # drafted on the device
                    assert in_flight is not None, "proposals drafted on the device need their InFlightTokens"
                    row = in_flight.rows[seq] + carried  # after the last token when that is in flight too
                    g.carried_to.extend(range(len(ids) - num_proposed, len(ids)))
                    g.carried_from.extend(range(row, row + num_proposed))
                g.spans.append((seq, len(logits_rows), 1 + num_proposed))
                logits_rows.extend(range(len(ids) - 1 - num_proposed, len(ids)))
            if k == 1 and start > 0:
                g.num_decodes += 1
            g.width = max(g.width, len(seq.block_ids))
        return g

    def _views(self, bucket: int, width: int, q: int) -> StepInputs:
        """The fixed views of a graph's layout (see the class), made once per graph."""
        key = (bucket, width, q)
        views = self._graph_views.get(key)
        if views is not None:
            return views
        d64, d32 = self._dev64, self._dev32
        padded = bucket * q
        table_at = bucket + 1 if q == 1 else 2 * bucket + 1
        tables = d32[table_at:table_at + bucket * width].view(bucket, width)
        empty = d32[:0]
        if q == 1:  # decodes
            meta = AttentionMetadata(
                slot_mapping=d64[2 * padded:3 * padded],
                num_decodes=bucket,
                decode_block_tables=tables,
                decode_seq_lens=d32[:bucket],
                prefill_cu_seqlens_q=d32[bucket:bucket + 1],
                prefill_seq_lens=empty,
                prefill_block_tables=tables[:0],
                prefill_max_seqlen_q=0,
                decode_seq_lens_host=[],
                prefill_q_lens_host=[],
                prefill_seq_lens_host=[],
            )
        else:  # q tokens after each context: the backend's verification path (paged_verify)
            meta = AttentionMetadata(
                slot_mapping=d64[2 * padded:3 * padded],
                num_decodes=0,
                decode_block_tables=tables[:0],
                decode_seq_lens=empty,
                prefill_cu_seqlens_q=d32[bucket:2 * bucket + 1],
                prefill_seq_lens=d32[:bucket],
                prefill_block_tables=tables,
                prefill_max_seqlen_q=q,
                decode_seq_lens_host=[],
                prefill_q_lens_host=[q] * bucket,
                prefill_seq_lens_host=[],  # unknown at capture: never taken for a fresh prompt
            )
        # A graph computes every row's logits: no logits indices.
        views = StepInputs(d64[:padded], d64[padded:2 * padded], meta, d64[:0], [])
        self._graph_views[key] = views
        return views

    def _next_staging(self) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]:
        """The next staging set: its int64 and int32 tensors, and numpy views of them."""
        self._turn = (self._turn + 1) % len(self._staging)
        done = self._copied[self._turn]
        if done is not None:
            done.synchronize()  # normally long complete: the copy was queued two steps ago
        return *self._staging[self._turn], *self._staging_np[self._turn]

    def _upload(self, host64: torch.Tensor, host32: torch.Tensor, used64: int, used32: int) -> None:
        if self.device.type != "cuda":
            return
        self._dev64[:used64].copy_(host64[:used64], non_blocking=True)
        self._dev32[:used32].copy_(host32[:used32], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._copied[self._turn] = event


class _BlockTableRows:
    """Each live sequence's block ids mirrored in a row of a host table, written
    incrementally. A row is recycled when its sequence is garbage collected."""

    def __init__(self, max_blocks: int) -> None:
        self.table = np.zeros((64, max_blocks), dtype=np.int32)
        self._row_of: weakref.WeakKeyDictionary[Sequence, int] = weakref.WeakKeyDictionary()
        self._written = np.zeros(64, dtype=np.int64)
        self._version = np.zeros(64, dtype=np.int64)
        # Each row's table id (AttentionMetadata.decode_table_ids): a new one whenever the
        # row is rewritten from its first block (a new sequence, its version bumped).
        self.table_ids = np.zeros(64, dtype=np.int64)
        self._next_id = 0
        self._free = list(range(63, -1, -1))

    def update(self, seq: Sequence) -> int:
        """`seq`'s row, brought up to date with `seq.block_ids`."""
        row = self._row_of.get(seq)
        if row is None:
            row = self._new_row()
            self._row_of[seq] = row
            weakref.finalize(seq, self._free.append, row)
            self._restart(row, seq)
        elif self._version[row] != seq.block_table_version:
            self._restart(row, seq)
        written, blocks = int(self._written[row]), seq.block_ids
        if len(blocks) > written:
            self.table[row, written:len(blocks)] = blocks[written:]
            self._written[row] = len(blocks)
        return row

    def _restart(self, row: int, seq: Sequence) -> None:
        self._written[row] = 0
        self._version[row] = seq.block_table_version
        self._next_id += 1
        self.table_ids[row] = self._next_id

    def _new_row(self) -> int:
        if not self._free:
            old = len(self._written)
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self._written = np.concatenate([self._written, np.zeros(old, dtype=np.int64)])
            self._version = np.concatenate([self._version, np.zeros(old, dtype=np.int64)])
            self.table_ids = np.concatenate([self.table_ids, np.zeros(old, dtype=np.int64)])
            self._free.extend(range(2 * old - 1, old - 1, -1))
        return self._free.pop()
