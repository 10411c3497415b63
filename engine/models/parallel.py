"""Tensor parallelism: how one model splits over N ranks, and the collectives between them.

As in Megatron and vLLM: the attention heads and the MLP's intermediate dimension are
split over the ranks (q/k/v and gate/up are column-parallel, o_proj and down_proj
row-parallel, each followed by an all-reduce), the vocabulary too (embedding and LM
head; the logits are all-gathered). KV heads are split like the query heads when there
are at least as many as ranks, else replicated: rank r then holds KV head
r // (N / num_kv_heads), the one its query heads read.

The collectives run on a process group of their own, built from a `FileStore` in a
private folder (no listener for the rendezvous) and, for gloo, bound to 127.0.0.1: the
ranks of one worker always share a host. Nothing here touches torch.distributed's
default group, so a process can hold several tensor-parallel engines.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.engine.models.arch import ModelArch


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """What rank `rank` of `size` holds of a model."""

    rank: int
    size: int
    num_heads: int  # query heads of this rank
    num_kv_heads: int  # KV heads of this rank (1 when they are replicated)
    kv_head_start: int  # the model's index of this rank's first KV head
    intermediate_size: int  # this rank's slice of the MLP
    vocab_per_rank: int  # embedding / LM-head rows per rank (the vocabulary padded up to size x this)
    vocab_size: int  # the model's
    # Mixture of Experts (zeros for a dense model): the experts this rank holds, first_expert
    # onwards (every expert under tensor parallelism, num_experts / size under expert
    # parallelism), the slice of each one's intermediate dimension it holds (all of it under
    # expert parallelism), and its slice of the shared expert's.
    num_local_experts: int = 0
    first_expert: int = 0
    expert_intermediate_size: int = 0
    shared_intermediate_size: int = 0
    expert_parallel: bool = False

    @classmethod
    def of(cls, arch: ModelArch, rank: int = 0, size: int = 1, expert_parallel: bool = False) -> ShardPlan:
        """Rank `rank`'s share of `arch`; ValueError naming the dimension that does not split."""
        check_splits(arch, size, expert_parallel)
        if not 0 <= rank < size:
            raise ValueError(f"tensor-parallel rank {rank} is outside [0, {size})")
        if arch.num_kv_heads >= size:
            kv_heads, kv_start = arch.num_kv_heads // size, rank * (arch.num_kv_heads // size)
        else:
            kv_heads, kv_start = 1, rank // (size // arch.num_kv_heads)
        experts: dict[str, int | bool] = {}
        if arch.moe is not None:
            moe = arch.moe
            if expert_parallel:
                per_rank = moe.num_experts // size
                experts = dict(num_local_experts=per_rank, first_expert=rank * per_rank,
                               expert_intermediate_size=moe.intermediate_size, expert_parallel=True)
            else:
                experts = dict(num_local_experts=moe.num_experts,
                               expert_intermediate_size=moe.intermediate_size // size)
            experts["shared_intermediate_size"] = moe.shared_intermediate_size // size
        return cls(rank=rank, size=size, num_heads=arch.num_heads // size, num_kv_heads=kv_heads,
                   kv_head_start=kv_start, intermediate_size=arch.intermediate_size // size,
                   vocab_per_rank=-(-arch.vocab_size // size), vocab_size=arch.vocab_size, **experts)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    @property
    def vocab_rows(self) -> int:
        """Rows of this rank's vocabulary slice that are real tokens (the rest is padding)."""
        return max(0, min(self.vocab_per_rank, self.vocab_size - self.vocab_start))


def check_splits(arch: ModelArch, size: int, expert_parallel: bool = False) -> None:
    """ValueError unless `arch` splits over `size` ranks (its experts whole, one share of
    them per rank, under `expert_parallel`)."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if arch.num_heads % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's {arch.num_heads} attention heads")
    if arch.num_kv_heads % size and size % arch.num_kv_heads:
        raise ValueError(f"tensor_parallel_size {size} neither divides the model's {arch.num_kv_heads} KV heads "
                         f"nor is a multiple of them")
    if arch.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the MLP's {arch.intermediate_size}")
    moe = arch.moe
    if moe is None:
        if expert_parallel and size > 1:
            raise ValueError("enable_expert_parallel needs a Mixture-of-Experts model; this one is dense")
        return
    if expert_parallel and moe.num_experts % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's {moe.num_experts} experts "
                         f"(expert parallelism gives each rank an equal share)")
    if not expert_parallel and moe.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the experts' intermediate size "
                         f"{moe.intermediate_size}")
    if moe.shared_intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the shared expert's "
                         f"{moe.shared_intermediate_size}")


class Collectives(Protocol):
    """What the model's layers need of the other ranks."""

    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns it."""
        ...

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] of every rank -> [..., size * n], rank order along the last dimension."""
        ...

    def broadcast(self, x: torch.Tensor, root: int = 0) -> torch.Tensor:
        """Rank `root`'s `x` into every rank's `x`; returns it."""
        ...


class SingleRank:
    """The collectives of a model that is not split: nothing to exchange."""

    size = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def broadcast(self, x: torch.Tensor, root: int = 0) -> torch.Tensor:
        return x


class ProcessGroupCollectives:
    """Collectives over a torch.distributed backend (gloo on the CPU, NCCL on CUDA) that is
    not registered as any default group: its calls go to the backend object directly."""

    def __init__(self, backend: torch.distributed.Backend, size: int) -> None:
        self._pg = backend
        self.size = size

    @classmethod
    def connect(cls, store_path: str, rank: int, size: int, device: torch.device,
                timeout_s: float) -> ProcessGroupCollectives:
        """Join the group whose rendezvous file is `store_path` (every rank passes the same);
        returns once all `size` ranks have joined, or raises after `timeout_s`."""
        from torch.distributed import FileStore

        store = FileStore(store_path, size)
        timeout = datetime.timedelta(seconds=timeout_s)
        if device.type == "cuda":
            from torch.distributed import ProcessGroupNCCL

            options = ProcessGroupNCCL.Options()
            options._timeout = timeout
            return cls(ProcessGroupNCCL(store, rank, size, options), size)
        from torch.distributed import ProcessGroupGloo

        options = ProcessGroupGloo._Options()
        options._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        options._timeout = timeout
        return cls(ProcessGroupGloo(store, rank, size, options), size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self._pg.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._pg.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor, root: int = 0) -> torch.Tensor:
        self._pg.broadcast(x, root).wait()
        return x


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """A rank's share of the model and its link to the other ranks."""

    plan: ShardPlan
    comm: Collectives

    @classmethod
    def single(cls, arch: ModelArch) -> TensorParallel:
        return cls(ShardPlan.of(arch), SingleRank())
