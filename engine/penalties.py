"""Presence, frequency and repetition penalties, logit bias and min_tokens, on the device for
a whole batch, with no read of the device.

Each penalized sequence owns a row (a slot) of `_history`, its token ids on the device: the
prompt and what it has generated, written once from the host when the slot is taken (or when
tokens arrive that only the host has: a verification's emitted tokens, a decode worker's
first token) and, for a token an overlapped step samples, on the device right behind the
sampling (`record`), so the next step reads it before the host knows it. A preempted sequence
keeps its slot (its tokens do not change; its re-prefill samples after them); a finished one
gives it back (`release`).

The penalties act on the tokens a row has, never on a dense [rows, vocab] count: a gather of
each row's logits at its token ids, the penalty, a scatter back (frequency per occurrence
through `scatter_add_`, presence once per distinct id after a sort). On the 2-core CPU a
64-row step paid 26 ms for the dense form and 1.5 ms for this one.

Definitions: OpenAI's presence and frequency penalties count the generated tokens (a migrated
request's earlier output too, which its prompt ends with); Hugging Face's repetition penalty
counts the prompt and the output; applied in vLLM's order: bias and min_tokens, repetition,
then frequency and presence. Speculative verification applies them at each of a row's K + 1
positions with the proposed tokens before it counted (`adjusted_proposals`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.sampler import on_device
from pdserve.engine.sequence import PLACEHOLDER_TOKEN_ID, Sequence


@dataclass(slots=True)
class _Slot:
    row: int  # of `_history` and the bias tensors
    num_written: int  # the sequence's leading tokens written in its history row
    num_prompt: int  # of them, the ones that are not output (the prompt less a migrated request's earlier output)


class Penalties:
    """One engine's penalty state: a history row per live penalized sequence.

    vocab_size: the logits' width; eos_token_ids: what min_tokens holds off besides each
    request's stop_token_ids (unless it ignores EOS).
    """

    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...], device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = device
        self._history = torch.zeros((0, 0), dtype=torch.int64, device=device)  # [slots, width] token ids
        self._bias_ids = torch.zeros((0, 0), dtype=torch.int64, device=device)  # [slots, max biases], 0-padded
        self._bias_values = torch.zeros((0, 0), dtype=torch.float32, device=device)  # 0 on padding
        self._slots: dict[Sequence, _Slot] = {}
        self._free_rows: list[int] = []

    def adjusted(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """The logits to sample from for rows [N, vocab], row i the next token of seqs[i]:
        `logits` itself when no row is penalized (no work at all), else a copy with each
        penalized row's penalties, bias and min_tokens applied (the original stays the
        model's, for the returned log-probabilities)."""
        rows = [i for i, seq in enumerate(seqs) if seq.params.penalized]
        if not rows:
            return logits
        out = logits.clone()
        penalized = [seqs[i] for i in rows]
        if len(rows) == len(seqs):
            self._apply(out, penalized, 1, None)
            return out
        index = on_device(rows, torch.int64, logits.device)
        part = out.index_select(0, index)
        self._apply(part, penalized, 1, None)
        return out.index_copy_(0, index, part)

    def adjusted_proposals(self, seqs: list[Sequence], logits: list[torch.Tensor], proposed: torch.Tensor,
                           proposal_rows: list[int]) -> list[torch.Tensor]:
        """A verification's logits to judge the proposals by: logits[i] [n_i + 1, vocab] for
        seqs[i], row j after its tokens and its first j proposals, proposed[proposal_rows[i], :j]
        (int64 on the device). Each penalized sequence's are a copy with row j penalized as if
        those j proposals had been generated; the others are returned as they are."""
        rows = [i for i, seq in enumerate(seqs) if seq.params.penalized]
        if not rows:
            return logits
        width = max(logits[i].shape[0] for i in rows)
        stacked = logits[rows[0]].new_zeros((len(rows), width, self.vocab_size))
        for r, i in enumerate(rows):
            stacked[r, :logits[i].shape[0]] = logits[i]
        extra = proposed.index_select(0, on_device([proposal_rows[i] for i in rows], torch.int64, proposed.device))
        extra = torch.nn.functional.pad(extra[:, :width - 1], (0, max(0, width - 1 - extra.shape[1])))
        flat = stacked.view(len(rows) * width, self.vocab_size)
        self._apply(flat, [seqs[i] for i in rows], width, extra)
        out = list(logits)
        for r, i in enumerate(rows):
            out[i] = stacked[r, :logits[i].shape[0]]
        return out

    def record(self, seqs: list[Sequence], token_ids: torch.Tensor) -> None:
        """A step sampled token_ids[i] ([N] int64 on the device) for seqs[i]: into the histories of
        the penalized ones, where the scheduler puts its placeholder (on the device: nothing waits)."""
        if not self._slots:  # no penalized sequence lives: no walk over the batch every step
            return
        rows, slot_rows, positions = [], [], []
        for i, seq in enumerate(seqs):
            slot = self._slots.get(seq)
            if slot is None:
                continue
            rows.append(i)
            slot_rows.append(slot.row)
            positions.append(slot.num_written)
            slot.num_written += 1
        if not rows:
            return
        index = on_device([rows, slot_rows, positions], torch.int64, self.device)
        self._history.index_put_((index[1], index[2]), token_ids.index_select(0, index[0]))

    def release(self, seq: Sequence) -> None:
        """`seq` is finished: its slot is free."""
        slot = self._slots.pop(seq, None)
        if slot is not None:
            self._free_rows.append(slot.row)

    # The work -------------------------------------------------------------------------

    def _apply(self, logits: torch.Tensor, seqs: list[Sequence], width: int, extra: torch.Tensor | None) -> None:
        """In place on logits [m * width, vocab]: row i * width + j is seqs[i]'s after its tokens
        and extra[i, :j] (extra: [m, width - 1] proposed tokens; None when width is 1)."""
        slots = self._synced(seqs)
        device, m = logits.device, len(seqs)
        params = [seq.params for seq in seqs]
        ints = on_device([[s.row for s in slots], [seq.num_tokens for seq in seqs], [s.num_prompt for s in slots]],
                         torch.int64, device)
        floats = on_device([[p.repetition_penalty for p in params], [p.frequency_penalty for p in params],
                            [p.presence_penalty for p in params]], torch.float32, device)
        if width > 1:
            ints, floats = ints.repeat_interleave(width, dim=1), floats.repeat_interleave(width, dim=1)
        slot_rows, num_tokens, num_prompt = ints
        repetition, frequency, presence = floats[:, :, None]
        if any(p.logit_bias for p in params):
            self._add_bias(logits, slot_rows)
        self._hold_off_stops(logits, seqs, width)
        if all(p.repetition_penalty == 1.0 and not p.frequency_penalty and not p.presence_penalty for p in params):
            return
        num_known = max(seq.num_tokens for seq in seqs)
        ids = self._history[:, :num_known].index_select(0, ints[0, ::width])  # [m, num_known]
        positions = torch.arange(num_known + width - 1, device=device)
        seen = positions[None, :] < num_tokens[:, None]
        if extra is not None:
            ids = torch.cat([ids, extra], dim=1)
            # Row j counts the first j proposals.
            proposal = positions[None, num_known:] - num_known
            seen[:, num_known:] = proposal < torch.arange(width, device=device).repeat(m)[:, None]
        ids = ids.repeat_interleave(width, dim=0) if width > 1 else ids
        if any(p.repetition_penalty != 1.0 for p in params):
            _repetition(logits, ids, seen, repetition)
        if any(p.frequency_penalty or p.presence_penalty for p in params):
            output = seen & (positions[None, :] >= num_prompt[:, None])
            _frequency_presence(logits, ids, output, frequency, presence, self.vocab_size)

    def _add_bias(self, logits: torch.Tensor, slot_rows: torch.Tensor) -> None:
        logits.scatter_add_(1, self._bias_ids.index_select(0, slot_rows), self._bias_values.index_select(0, slot_rows))

    def _hold_off_stops(self, logits: torch.Tensor, seqs: list[Sequence], width: int) -> None:
        """EOS and stop token ids to -inf at the positions before min_tokens generated tokens."""
        rows, token_ids = [], []
        for i, seq in enumerate(seqs):
            p = seq.params
            num_held = min(p.min_tokens - seq.next_output_index, width)
            if num_held <= 0:
                continue
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
            for j in range(num_held):
                rows += [i * width + j] * len(stops)
                token_ids += stops
        if rows:
            index = on_device([rows, token_ids], torch.int64, logits.device)
            logits.index_put_((index[0], index[1]), torch.tensor(float("-inf"), device=logits.device))

    def _synced(self, seqs: list[Sequence]) -> list[_Slot]:
        """Each sequence's slot (taken now for a new one), its history holding every token the
        sequence has: what only the host has is written now, in one copy."""
        slots = [self._slots.get(seq) or self._take(seq) for seq in seqs]
        self._reserve(max(s.row for s in slots) + 1, max(seq.num_tokens for seq in seqs) + 1)
        rows, positions, token_ids = [], [], []
        for seq, slot in zip(seqs, slots):
            new = seq.token_ids[slot.num_written:]
            if not new:
                continue
            assert PLACEHOLDER_TOKEN_ID not in new, "a token sampled on the device is recorded there"
            rows += [slot.row] * len(new)
            positions += range(slot.num_written, slot.num_written + len(new))
            token_ids += new
            slot.num_written = seq.num_tokens
        if rows:
            index = on_device([rows, positions, token_ids], torch.int64, self.device)
            self._history.index_put_((index[0], index[1]), index[2])
        return slots

    def _take(self, seq: Sequence) -> _Slot:
        row = self._free_rows.pop() if self._free_rows else len(self._slots)
        slot = self._slots[seq] = _Slot(row, 0, seq.num_prompt_tokens - seq.num_prior_output_tokens)
        bias = seq.params.logit_bias
        self._reserve(row + 1, 1, len(bias))
        if bias or self._bias_ids.shape[1]:
            ids = [t for t, _ in bias] + [0] * (self._bias_ids.shape[1] - len(bias))
            values = [v for _, v in bias] + [0.0] * (self._bias_ids.shape[1] - len(bias))
            self._bias_ids[row] = on_device(ids, torch.int64, self.device)
            self._bias_values[row] = on_device(values, torch.float32, self.device)
        return slot

    def _reserve(self, num_rows: int, width: int, num_biases: int = 0) -> None:
        """Grow the tensors (doubling, on the device) to hold `num_rows` slots of `width` tokens
        and `num_biases` biases."""
        rows, cols = self._history.shape
        if num_rows > rows or width > cols:
            self._history = _grown(self._history, max(num_rows, 2 * rows if num_rows > rows else rows),
                                   max(width, 2 * cols if width > cols else cols, 256))
        rows, cols = self._bias_ids.shape
        if num_rows > rows or num_biases > cols:
            new_rows = max(num_rows, 2 * rows if num_rows > rows else rows)
            self._bias_ids = _grown(self._bias_ids, new_rows, max(num_biases, cols))
            self._bias_values = _grown(self._bias_values, new_rows, max(num_biases, cols))


def _grown(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    out = t.new_zeros((rows, cols))
    out[:t.shape[0], :t.shape[1]] = t
    return out


def _repetition(logits: torch.Tensor, ids: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> None:
    """HF's: each seen token's logit divided by the penalty when positive, else multiplied.
    Unseen positions point at the row's first token (always seen: a prompt is never empty),
    whose new value every duplicate writes alike."""
    ids = torch.where(seen, ids, ids[:, :1])
    values = logits.gather(1, ids)
    logits.scatter_(1, ids, torch.where(values > 0, values / penalty, values * penalty))


def _frequency_presence(logits: torch.Tensor, ids: torch.Tensor, output: torch.Tensor, frequency: torch.Tensor,
                        presence: torch.Tensor, vocab_size: int) -> None:
    """OpenAI's: frequency_penalty off a token's logit per occurrence in the output, presence_penalty
    once. Sorting each row's output ids puts an id's occurrences together: its first one takes the
    presence penalty. Positions that are not output sort last (as `vocab_size`) and weigh nothing."""
    ids = torch.where(output, ids, vocab_size).sort(dim=1).values
    first = torch.ones_like(ids, dtype=torch.bool)
    first[:, 1:] = ids[:, 1:] != ids[:, :-1]
    weights = (frequency + presence * first) * (ids < vocab_size)
    logits.scatter_add_(1, ids.clamp(max=vocab_size - 1), -weights)
