"""What an engine is made of, built from its config: the model on its device (with the
other tensor-parallel ranks in processes of their own), the KV pool sized to the memory
left, and the step machinery (attention backend, step inputs, CUDA graphs, runner).

`Engine` (engine.py) owns these parts; its step core (`EngineCore`, step_core.py) drives
requests through them.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.engine.attention import backend_for
from pdserve.engine.attention.triton_mla import mla_verify_fits
from pdserve.engine.config import EngineConfig, cpu_bf16_matmul
from pdserve.engine.kv.budget import blocks_that_fit, draft_memory
from pdserve.engine.kv.pool import KVLayout, KVPool
from pdserve.engine.models.arch import ModelArch
from pdserve.engine.models.decoder import CausalLM
from pdserve.engine.models.parallel import ShardPlan, TensorParallel, check_splits
from pdserve.engine.models.weights import ModelFiles, load_tokenizer, model_digest, resolve_model
from pdserve.engine.runner.cuda_graphs import StepGraphs
from pdserve.engine.runner.executor import Executor, kv_layout, load_shard
from pdserve.engine.runner.model_runner import ModelRunner
from pdserve.engine.runner.step_inputs import StepInputBuilder
from pdserve.engine.runner.tensor_parallel import TensorParallelRanks
from pdserve.engine.sampler import Sampler
from pdserve.kernels.paged_decode import paged_verify_fits

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineParts:
    model_name: str
    model_digest: str  # the weights' and config's (weights.model_digest): what stored KV belongs to
    arch: ModelArch
    device: torch.device
    dtype: torch.dtype
    tokenizer: Any | None  # transformers' tokenizer; None for a model without one (dummy weights)
    ranks: TensorParallelRanks | None  # ranks 1..N-1 of a tensor-parallel engine (None: one rank)
    model: CausalLM
    pool: KVPool
    kv_shards: list[tuple[torch.Tensor, int]]  # every rank's pool and its first KV head
    kv_wire_layout: KVLayout  # the KV of every head as one rank lays it out: what moves between workers
    max_model_len: int
    sampler: Sampler
    runner: ModelRunner


def assemble(config: EngineConfig) -> EngineParts:
    """Load the model, size and allocate the KV pool, capture the step graphs.

    Raises ValueError for a max_model_len past the model's context or the pool's capacity.
    """
    files = with_drafter_layers(resolve_model(config.model), config)
    arch = files.arch
    device, dtype = config.model.torch_device(), config.model.torch_dtype()
    if config.model.dtype == "auto" and device.type == "cpu":
        units = cpu_bf16_matmul()
        logger.warning("dtype auto on this CPU: %s (%s)", dtype, f"it has {units}" if units
                       else "no AMX or AVX512-BF16: bfloat16 would be emulated")
    tokenizer = load_tokenizer(files)
    limit = config.model.max_model_len or arch.max_position_embeddings
    if limit > arch.max_position_embeddings:
        raise ValueError(f"max_model_len {limit} exceeds the model's context ({arch.max_position_embeddings})")
    ranks, tp = None, None
    if config.parallel.tensor_parallel_size > 1:
        expert_parallel = config.parallel.enable_expert_parallel
        check_splits(arch, config.parallel.tensor_parallel_size, expert_parallel)
        ranks = TensorParallelRanks(config, limit)
        tp = TensorParallel(ShardPlan.of(arch, 0, ranks.size, expert_parallel), ranks.comm)
    try:
        return _assemble(config, files, tokenizer, limit, ranks, tp, device, dtype)
    except BaseException:
        if ranks is not None:
            ranks.close()
        raise


def with_drafter_layers(files: ModelFiles, config: EngineConfig) -> ModelFiles:
    """`files` with the layers `config.spec` drafts with built too: the checkpoint's MTP layer
    for method "mtp" (its KV one more layer of the pool). ValueError naming why not."""
    if config.spec.method != "mtp":
        return files
    return dataclasses.replace(files, arch=files.arch.with_mtp())


def _assemble(config: EngineConfig, files: ModelFiles, tokenizer: Any | None, limit: int,
              ranks: TensorParallelRanks | None, tp: TensorParallel | None, device: torch.device,
              dtype: torch.dtype) -> EngineParts:
    arch = files.arch
    model, layout = load_shard(config, files, limit, device, tp)
    kv_dtype = layout.dtype
    num_blocks = config.cache.num_blocks or blocks_that_fit(config, layout, device, draft_memory(config, arch))
    pool = KVPool(layout, num_blocks, device)
    kv_shards = [(pool.kv, layout.kv_head_start)]
    if ranks is not None:
        kv_shards += ranks.open_pools(num_blocks)
    wire_layout = kv_layout(files, kv_dtype, ShardPlan.of(arch), config.cache.block_size)
    capacity = num_blocks * layout.block_size
    if config.model.max_model_len is not None and capacity < limit:
        raise ValueError(f"max_model_len {limit} needs {limit} KV slots; the pool has {capacity}")
    max_model_len = min(limit, capacity)
    sampler = Sampler(config.model.seed, device)
    executor = Executor(model, pool, backend_for(device, dtype, config.cache.fp8_attention_dot))
    sched = config.scheduler
    inputs = StepInputBuilder(layout.block_size, -(-max_model_len // layout.block_size),
                              max(sched.max_num_batched_tokens, sched.max_num_seqs), sched.max_num_seqs, device)
    graphs = None
    if ranks is not None and device.type == "cuda":
        logger.info("tensor parallelism: steps run eagerly (no CUDA graphs yet)")
    elif device.type == "cuda" and model.mtp is not None:
        # The MTP layer's KV is written from each step's hidden states (mtp_carry.py), outside a graph.
        logger.info("MTP drafting: steps run eagerly (no CUDA graphs yet)")
    elif device.type == "cuda" and not config.model.enforce_eager:
        # Verification steps of K + 1 tokens per sequence (every K adaptive K may pick), of
        # the sizes the attention takes without host values (a latent pool: absorbed).
        spec = config.spec
        if layout.kind == "mla":
            fits = mla_verify_fits
        else:
            def fits(q: int) -> bool:
                return paged_verify_fits(q, arch.num_heads // arch.num_kv_heads)
        verify = tuple(k + 1 for k in range(1, spec.num_speculative_tokens + 1) if spec.enabled and fits(k + 1))
        graphs = StepGraphs(executor, inputs, sched.max_num_seqs, (1, *verify), spec.max_graph_batch)
        graphs.capture()
    runner = ModelRunner(executor, sampler, inputs, graphs, ranks)
    logger.info("engine ready: %s on %s (%s, tensor parallel %d), %d KV blocks of %d tokens (%s), max_model_len %d",
                files.name, device, dtype, config.parallel.tensor_parallel_size, num_blocks, layout.block_size,
                kv_dtype, max_model_len)
    return EngineParts(files.name, model_digest(files, config.model.seed), arch, device, dtype, tokenizer, ranks,
                       model, pool, kv_shards, wire_layout,
                       max_model_len, sampler, runner)
