"""The other ranks of a tensor-parallel engine: started by rank 0, driven step by step.

Rank 0 (the engine's process) schedules, builds each step's inputs and samples. Ranks
1..N-1 run in processes of their own (spawned: no state of rank 0's is inherited), each
with its shard of the model and of the KV pool: the same block ids, its own KV heads.
For every forward rank 0 sends the step's shape over a pipe (a few ints, plus the host
lists the CPU attention plans with) and its tensors by one broadcast per dtype; then
every rank runs the same forward, and the all-reduces and the logits' all-gather meet
in the process group. The sampled tokens stay with rank 0: the other ranks never need
them (the next step's ids come in its broadcast).

An idle rank waits on its pipe without a timeout (idle is not dead) and ends when the
pipe closes (rank 0 is gone) or says stop. A rank that fails sends its traceback on the
pipe and exits; rank 0's collectives then fail (gloo/NCCL timeout at the latest) and
`check` names the rank and its error.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import shutil
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdserve.engine.attention import AttentionMetadata, backend_for
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv.pool import KVPool
from pdserve.engine.models.parallel import ProcessGroupCollectives, ShardPlan, TensorParallel
from pdserve.engine.models.weights import resolve_model
from pdserve.engine.runner.executor import Executor, load_shard
from pdserve.engine.runner.step_inputs import StepInputs

logger = logging.getLogger(__name__)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank `rank`'s device: the CPU for every rank on the CPU, else the rank-th GPU from
    rank 0's (cuda:k -> cuda:k+rank)."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


@dataclass(frozen=True, slots=True)
class _StepShape:
    """What a rank needs besides the broadcast tensors to run the step rank 0 built."""

    num_tokens: int
    num_logits: int
    num_decodes: int
    decode_width: int
    prefill_width: int
    prefill_max_seqlen_q: int
    decode_seq_lens_host: list[int]
    prefill_q_lens_host: list[int]
    prefill_seq_lens_host: list[int]

    @property
    def num_prefills(self) -> int:
        return len(self.prefill_q_lens_host)

    @property
    def num64(self) -> int:  # ids | positions | slots | logits rows
        return 3 * self.num_tokens + self.num_logits

    @property
    def num32(self) -> int:  # decode seq lens | prefill cu_seqlens | prefill seq lens | the two tables
        nd, np_ = self.num_decodes, self.num_prefills
        return nd + (np_ + 1) + np_ + nd * self.decode_width + np_ * self.prefill_width


class TensorParallelRanks:
    """Rank 0's handle on ranks 1..N-1: start them, send each step, stop them."""

    def __init__(self, config: EngineConfig, max_positions: int) -> None:
        """Start the other ranks and join their process group (returns once all have
        joined; bounded by `config.parallel.collective_timeout_s`)."""
        par = config.parallel
        self.size = par.tensor_parallel_size
        self._timeout_s = par.startup_timeout_s
        self._dir = Path(tempfile.mkdtemp(prefix="pdserve-tp-"))  # 0700: the rendezvous file is private
        store = str(self._dir / "store")
        ctx = torch.multiprocessing.get_context("spawn")
        self._conns: list[multiprocessing.connection.Connection] = []
        self._procs: list[Any] = []
        for rank in range(1, self.size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=follow, args=(config, rank, store, max_positions, theirs),
                               name=f"pdserve-tp-rank{rank}", daemon=True)
            proc.start()
            theirs.close()
            self._conns.append(ours)
            self._procs.append(proc)
        device = config.model.torch_device()
        self.comm = ProcessGroupCollectives.connect(store, 0, self.size, device, par.collective_timeout_s)
        self._device = device
        self._closed = False

    def open_pools(self, num_blocks: int) -> list[tuple[torch.Tensor, int]]:
        """Have every rank allocate its pool of `num_blocks` blocks; returns once all are
        ready to step (bounded by `startup_timeout_s`: their model load comes before), with
        their pools (shared memory on the CPU, CUDA IPC mappings on GPUs) and first KV heads,
        for the KV transport to read and write."""
        for conn in self._conns:
            conn.send(("pool", num_blocks))
        pools = []
        for rank, conn in enumerate(self._conns, start=1):
            if not conn.poll(self._timeout_s):
                raise RuntimeError(f"tensor-parallel rank {rank} was not ready within {self._timeout_s:.0f} s")
            reply = conn.recv()
            if reply[0] != "ready":
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {reply[1]}")
            pools.append((reply[1], reply[2]))
        return pools

    def run_step(self, inputs: StepInputs) -> None:
        """Send the step rank 0 is about to run to every other rank (before rank 0's own
        forward: the forward's collectives need them)."""
        meta = inputs.meta
        shape = _StepShape(
            num_tokens=inputs.input_ids.shape[0], num_logits=inputs.logits_indices.shape[0],
            num_decodes=meta.num_decodes, decode_width=meta.decode_block_tables.shape[1],
            prefill_width=meta.prefill_block_tables.shape[1], prefill_max_seqlen_q=meta.prefill_max_seqlen_q,
            decode_seq_lens_host=meta.decode_seq_lens_host, prefill_q_lens_host=meta.prefill_q_lens_host,
            prefill_seq_lens_host=meta.prefill_seq_lens_host)
        self.check()
        for conn in self._conns:
            conn.send(("step", shape))
        self.comm.broadcast(torch.cat([inputs.input_ids, inputs.positions, meta.slot_mapping, inputs.logits_indices]))
        self.comm.broadcast(torch.cat([meta.decode_seq_lens, meta.prefill_cu_seqlens_q, meta.prefill_seq_lens,
                                       meta.decode_block_tables.reshape(-1), meta.prefill_block_tables.reshape(-1)]))

    @property
    def processes(self) -> list[Any]:
        """The processes of ranks 1..N-1, in rank order."""
        return list(self._procs)

    def check(self) -> None:
        """RuntimeError naming a rank that has died or reported an error."""
        for rank, (conn, proc) in enumerate(zip(self._conns, self._procs), start=1):
            if conn.poll():
                try:
                    reply = conn.recv()
                except EOFError:  # it died: its end of the pipe closed
                    proc.join(self._timeout_s)
                    raise RuntimeError(f"tensor-parallel rank {rank} exited (code {proc.exitcode})") from None
                raise RuntimeError(f"tensor-parallel rank {rank} failed: {reply[1]}")
            if not proc.is_alive():
                raise RuntimeError(f"tensor-parallel rank {rank} exited (code {proc.exitcode})")

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the other ranks (idempotent): each gets `timeout_s` to exit, then is killed."""
        if self._closed:
            return
        self._closed = True
        for conn in self._conns:
            try:
                conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout_s)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout_s)
        for conn in self._conns:
            conn.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def follow(config: EngineConfig, rank: int, store: str, max_positions: int,
           conn: multiprocessing.connection.Connection) -> None:
    """A rank's process: load its shard, then run every step rank 0 sends until told to stop."""
    try:
        _Follower(config, rank, store, max_positions, conn).serve()
    except EOFError:  # rank 0 is gone
        pass
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        raise


class _Follower:
    def __init__(self, config: EngineConfig, rank: int, store: str, max_positions: int,
                 conn: multiprocessing.connection.Connection) -> None:
        size = config.parallel.tensor_parallel_size
        if config.model.torch_device().type == "cpu":
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))  # the ranks share the cores
        self.device = device = rank_device(config.model.torch_device(), rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        comm = ProcessGroupCollectives.connect(store, rank, size, device, config.parallel.collective_timeout_s)
        files = resolve_model(config.model)
        self.comm = comm
        self.conn = conn
        plan = ShardPlan.of(files.arch, rank, size, config.parallel.enable_expert_parallel)
        self.model, self.layout = load_shard(config, files, max_positions, device, TensorParallel(plan, comm))
        self.backend = backend_for(device, config.model.torch_dtype(), config.cache.fp8_attention_dot)
        self.executor: Executor | None = None  # once rank 0 has sized the pool

    def serve(self) -> None:
        while True:
            message = self.conn.recv()
            if message[0] == "stop":
                return
            if message[0] == "pool":
                pool = KVPool(self.layout, message[1], self.device)
                if self.device.type == "cpu":
                    pool.kv.share_memory_()  # rank 0's KV transport reads and writes it
                self.executor = Executor(self.model, pool, self.backend)
                self.conn.send(("ready", pool.kv, self.layout.kv_head_start))
            else:
                self._step(message[1])

    @torch.inference_mode()
    def _step(self, shape: _StepShape) -> None:
        """Rank 0's step, rebuilt from its shape and broadcasts, through this rank's executor."""
        assert self.executor is not None, "a step before the pool"
        t, nd, np_ = shape.num_tokens, shape.num_decodes, shape.num_prefills
        i64 = self.comm.broadcast(torch.empty(shape.num64, dtype=torch.int64, device=self.device))
        i32 = self.comm.broadcast(torch.empty(shape.num32, dtype=torch.int32, device=self.device))
        ids, positions, slots, logits_rows = i64.split([t, t, t, shape.num_logits])
        seq_lens, cu_q, prefill_lens, dtab, ptab = i32.split(
            [nd, np_ + 1, np_, nd * shape.decode_width, np_ * shape.prefill_width])
        meta = AttentionMetadata(
            slot_mapping=slots, num_decodes=nd,
            decode_block_tables=dtab.view(nd, shape.decode_width), decode_seq_lens=seq_lens,
            prefill_cu_seqlens_q=cu_q, prefill_seq_lens=prefill_lens,
            prefill_block_tables=ptab.view(np_, shape.prefill_width),
            prefill_max_seqlen_q=shape.prefill_max_seqlen_q,
            decode_seq_lens_host=shape.decode_seq_lens_host, prefill_q_lens_host=shape.prefill_q_lens_host,
            prefill_seq_lens_host=shape.prefill_seq_lens_host)
        self.executor.forward(StepInputs(ids, positions, meta, logits_rows, spans=[]))
