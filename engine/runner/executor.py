"""The one place a model is loaded for a rank and its forward runs.

`load_shard` builds one rank's shard of the model and the layout of its KV pool: rank 0
(`assembly`) and every other tensor-parallel rank (`tensor_parallel`) call it, so they
cannot disagree on what a rank holds. An `Executor` is that model with its pool and
attention backend, and runs a step's forward from its inputs to its logits: the eager steps
of rank 0 (`model_runner`), the capture of the CUDA graphs (`cuda_graphs`), the steps of the
other ranks, and the draft model's steps (`engine/speculative`) all go through `forward`.
"""

from __future__ import annotations

import torch

from pdserve.engine.attention import AttentionBackend
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv.pool import KVLayout, KVPool
from pdserve.engine.models.arch import ModelArch
from pdserve.engine.models.decoder import CausalLM
from pdserve.engine.models.parallel import ShardPlan, TensorParallel
from pdserve.engine.models.weights import ModelFiles, load_model
from pdserve.engine.runner.step_inputs import StepInputs


def kv_layout(files: ModelFiles, dtype: torch.dtype, plan: ShardPlan, block_size: int) -> KVLayout:
    """The layout of one rank's KV pool: its KV heads only (an MLA model's latent whole). It
    names the model by its name, family and a digest of its shape (two folders of one name
    but other models differ), and its FP8 weights where it has them (KV computed with other
    weights is other KV)."""
    arch = files.arch
    weights = f", FP8 weights {files.fp8_scheme.source}" if files.fp8_scheme is not None else ""
    return arch_kv_layout(f"{files.name} ({arch.model_type} {arch.digest}{weights})", dtype, arch, plan, block_size)


def arch_kv_layout(name: str, dtype: torch.dtype, arch: ModelArch, plan: ShardPlan, block_size: int) -> KVLayout:
    """The pool layout `plan`'s rank of `arch` holds: its KV heads' K and V, or (MLA) one
    latent per token, the same on every rank; one layer more for a model built with its MTP
    layer (runner/mtp_carry.py)."""
    if arch.mla is not None:
        return KVLayout(name, dtype, arch.num_layers + arch.mtp, 1, arch.mla.latent_dim, block_size, tp_size=plan.size,
                        kind="mla")
    return KVLayout(name, dtype, arch.num_layers, plan.num_kv_heads, arch.head_dim, block_size, tp_size=plan.size,
                    kv_head_start=plan.kv_head_start)


def load_shard(config: EngineConfig, files: ModelFiles, max_positions: int, device: torch.device,
               tp: TensorParallel | None) -> tuple[CausalLM, KVLayout]:
    """One rank's shard of the model (`tp`'s plan; None: the whole model), loaded on
    `device`, and the layout of that rank's KV pool."""
    dtype = config.model.torch_dtype()
    model = load_model(files, max_positions, device, dtype, config.model.seed, tp)
    return model, kv_layout(files, config.cache.kv_dtype(dtype), model.tp.plan, config.cache.block_size)


class Executor:
    """A model, its KV pool and its attention backend: runs steps."""

    def __init__(self, model: CausalLM, pool: KVPool, backend: AttentionBackend) -> None:
        self.model = model
        self.pool = pool
        self.backend = backend
        self.device = pool.kv.device
        self.scale = model.arch.softmax_scale

    def forward(self, inputs: StepInputs, every_row: bool = False) -> torch.Tensor | None:
        """Run the model over the step, writing its new tokens' KV into the pool. Returns
        float32 logits [rows, vocab] of the hidden rows `inputs.logits_indices` names (of
        every row with `every_row`, as a graph captures them), None when it names none (a
        step of mid-prompt chunks). Under tensor parallelism every rank calls this with the
        same step, and the logits' all-gather happens on all of them or none."""
        hidden = self.hidden(inputs)
        if every_row:
            return self.model.compute_logits(hidden)
        return self.logits(hidden, inputs)

    def hidden(self, inputs: StepInputs) -> torch.Tensor:
        """`forward` up to the final hidden states [num_tokens, hidden] (a step that also wants
        other rows' logits: prompt log-probabilities, `engine/prompt_logprobs.py`)."""
        step = self.backend.begin_step(inputs.meta, self.pool, self.scale)
        return self.model(inputs.input_ids, inputs.positions, step)

    def logits(self, hidden: torch.Tensor, inputs: StepInputs) -> torch.Tensor | None:
        """The logits of the rows `inputs.logits_indices` names (None: none)."""
        if not inputs.logits_indices.numel():
            return None
        return self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))
