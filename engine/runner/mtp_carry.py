"""The target's half of MTP drafting (`SpecConfig.method` "mtp", engine/models/mtp.py): after
every forward of the target, the MTP layer's KV for the step's tokens, written into the
pool's last layer (a model built with its MTP layer has num_layers + 1 of them), so that
the prefix cache, the tiers and a KV transfer carry it as they carry the target's.

Token i's entry needs the target's hidden state before it, h_{i-1}: the step's own row
before it, or for a sequence's first token in the step the last row a step before gave it
(kept here, per sequence: the last rows of its last step, enough for any verification to
leave the one the next step starts after). A sequence that has none (a fresh prompt's
token 0, a prefix-cache hit's first computed token, a recompute) gets zeros: its drafts may
be worse there, never its output. A decode worker gets the row its prefill worker's last
prompt token left (`export`, `adopt`), so that it drafts as it would colocated.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from pdserve.engine.attention.torch_ref import write_slots
from pdserve.engine.config import MAX_SPECULATIVE_TOKENS
from pdserve.engine.kv.pool import KVPool
from pdserve.engine.models.decoder import CausalLM
from pdserve.engine.runner.step_inputs import StepInputs
from pdserve.engine.sequence import Sequence

_KEPT_ROWS = MAX_SPECULATIVE_TOKENS + 1  # a verification's rows: the next step starts after any of them


@dataclass(slots=True)
class _Rows:
    first: int  # the position of rows[0]
    rows: torch.Tensor  # [n, hidden]: a view of the step's hidden states


class MTPCarry:
    def __init__(self, model: CausalLM, pool: KVPool) -> None:
        assert model.mtp is not None
        self.model = model
        self.pool = pool
        self.layer_idx = model.arch.num_layers  # the pool's last layer
        self._rows: weakref.WeakKeyDictionary[Sequence, _Rows] = weakref.WeakKeyDictionary()

    def row(self, seq: Sequence, position: int) -> torch.Tensor | None:
        """The target's hidden state [hidden] at `position` of `seq`, if a step left it here."""
        kept = self._rows.get(seq)
        if kept is None or not kept.first <= position < kept.first + kept.rows.shape[0]:
            return None
        return kept.rows[position - kept.first]

    def write_step(self, seqs: list[Sequence], counts: list[int], inputs: StepInputs, hidden: torch.Tensor) -> None:
        """After the target's forward of a step (seqs[j]'s counts[j] tokens after its computed
        ones, in the order of hidden's rows [T, hidden]): the MTP layer's KV of those tokens
        into the pool, at the slots the target's went to; then keep each one's last rows."""
        num_tokens = hidden.shape[0]
        previous = torch.zeros_like(hidden)
        previous[1:] = hidden[:-1]
        firsts, carried, start = [], [], 0
        for seq, n in zip(seqs, counts):
            firsts.append(start)
            row = self.row(seq, seq.num_computed_tokens - 1)
            carried.append(row if row is not None else hidden.new_zeros(hidden.shape[1]))
            start += n
        index = torch.tensor(firsts, dtype=torch.int64).to(hidden.device, non_blocking=True)
        previous.index_copy_(0, index, torch.stack(carried))
        kv_c, k_pe = self.model.mtp_latents(inputs.input_ids[:num_tokens], previous)
        k_pe = k_pe.unsqueeze(1)
        _, k_pe = self.model.rotary.at(inputs.positions[:num_tokens])(k_pe, k_pe)
        cache = self.pool.latent(self.layer_idx)
        write_slots(cache.view(-1, 1, cache.shape[-1]), inputs.meta.slot_mapping[:num_tokens],
                    torch.cat((kv_c.unsqueeze(1), k_pe), dim=-1))
        for seq, first, n in zip(seqs, firsts, counts):
            kept = min(n, _KEPT_ROWS)
            self._rows[seq] = _Rows(seq.num_computed_tokens + n - kept, hidden[first + n - kept:first + n])

    def export(self, seq: Sequence, position: int) -> bytes:
        """The hidden state at `position` as bytes (in the model's dtype), b"" if none is kept."""
        row = self.row(seq, position)
        if row is None:
            return b""
        return row.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()

    def adopt(self, seq: Sequence, position: int, data: bytes) -> None:
        """Keep `data` (`export`'s bytes from another engine of this model) as `seq`'s hidden
        state at `position`. ValueError when its size is not one hidden state's."""
        dtype, hidden_size = self.model.embed_tokens.weight.dtype, self.model.arch.hidden_size
        size = hidden_size * dtype.itemsize
        if len(data) != size:
            raise ValueError(f"an MTP hidden state is {size} bytes ({hidden_size} x {dtype}), got {len(data)}")
        row = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype)
        self._rows[seq] = _Rows(position, row.to(self.pool.kv.device).unsqueeze(0))
