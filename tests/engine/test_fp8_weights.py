"""FP8 weights against transformers on the same checkpoint, both dequantized to float32.

Checkpoints are made here (tests/engine/fp8_checkpoints.py): compressed-tensors per tensor
(with static input scales; also a Qwen3-MoE's experts, one by one), per channel and per
128 x 128 block, and quant_method "fp8" with DeepSeek-V3's block `weight_scale_inv` (dense
and Qwen3-MoE); Llama, Qwen3 and Qwen3-MoE layers. Our engine holds the e4m3
weights and their scales and, on the CPU, dequantizes them to float32 in each product; HF runs
its float32 model whose weights are the checkpoint's, dequantized. Only the order of the float32
sums differs: greedy tokens equal (near-ties aside, as in every HF comparison here) and each
token's log-probability within 1e-4 of HF's. Online quantization (`quantization="fp8"`) is
compared the same way with HF's weights quantized per channel and dequantized by torch here.
What pdserve does not run is refused at load, naming the field or the tensor.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.engine.engine import Engine
from pdserve.engine.models import fp8
from pdserve.engine.sampling import SamplingParams
from tests.engine.fp8_checkpoints import (
    DYNAMIC_TOKEN,
    FP8_BLOCK_CONFIG,
    STATIC_TENSOR,
    compressed_tensors_config,
    dequantize,
    quantize,
    rewrite,
    save_fp8_checkpoint,
)
from tests.engine.hf_reference import assert_matches_reference, hf_greedy

NEW_TOKENS = 8
# Block-scaled layers need every fused part on a 128-row block: q 256, k and v 128 rows, gate
# and up 256; hidden 192 leaves partial blocks (o_proj's and down_proj's rows, the K of
# qkv and gate_up).
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3, eos_token_id=None)
BLOCKED = dict(SMALL, hidden_size=192, intermediate_size=256, head_dim=64)


def _hf(family: str, shape: dict):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config, Qwen3MoeConfig

    if family == "llama":
        config = LlamaConfig(**shape)
    elif family == "qwen3":
        config = Qwen3Config(**shape, tie_word_embeddings=True)
    else:  # 8 experts, top 2, layer 1 dense; block scales need the experts' up rows on a block
        config = Qwen3MoeConfig(**shape, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                moe_intermediate_size=128 if shape is BLOCKED else 32, mlp_only_layers=[1])
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _engine(source: Path, **model) -> Engine:
    return Engine(EngineConfig(model=ModelConfig(source=str(source), device="cpu", dtype="float32", **model)))


def _assert_matches_hf(engine: Engine, hf, what: str) -> None:
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 250, (n,), generator=gen).tolist() for n in (5, 37)]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    for prompt, out in zip(prompts, engine.generate(prompts, params)):
        want, logits = hf_greedy(hf, prompt, NEW_TOKENS)
        assert_matches_reference(out.token_ids, want, logits, what)
        hf_logprobs = torch.log_softmax(logits, dim=-1)[torch.arange(len(want)), torch.tensor(want)]
        got = torch.tensor([lp.logprob for lp in out.logprobs])
        torch.testing.assert_close(got, hf_logprobs, atol=1e-4, rtol=1e-4, msg=what)


def _fp8_layers(engine: Engine) -> list[torch.nn.Module]:
    model = engine.model
    return [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in fp8.LAYERS]


CHECKPOINTS = {
    # name: (family, shape, strategy, quantization_config, scale tensor name, static input scales)
    "ct-tensor-static": ("llama", SMALL, "tensor", compressed_tensors_config("tensor", STATIC_TENSOR),
                         "weight_scale", True),
    "ct-channel-dynamic": ("qwen3", SMALL, "channel", compressed_tensors_config("channel", DYNAMIC_TOKEN),
                           "weight_scale", False),
    "ct-block-weight-only": ("llama", BLOCKED, "block", compressed_tensors_config("block", None), "weight_scale",
                             False),
    "fp8-block-deepseek": ("qwen3", BLOCKED, "block", FP8_BLOCK_CONFIG, "weight_scale_inv", False),
    "ct-tensor-moe": ("qwen3_moe", SMALL, "tensor", compressed_tensors_config("tensor", STATIC_TENSOR),
                      "weight_scale", True),
    "fp8-block-moe": ("qwen3_moe", BLOCKED, "block", FP8_BLOCK_CONFIG, "weight_scale_inv", False),
}


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_fp8_checkpoint_matches_hf_dequantized(name, tmp_path):
    family, shape, strategy, config, scale_name, input_scales = CHECKPOINTS[name]
    hf = _hf(family, shape)
    save_fp8_checkpoint(hf, tmp_path, strategy, config, scale_name, input_scales)
    engine = _engine(tmp_path)
    layers = _fp8_layers(engine)
    assert layers and all(m.weight.dtype == fp8.FP8 and m.fp8_blocked == (strategy == "block") for m in layers)
    if family == "qwen3_moe":
        experts = engine.model.layers[0].mlp.experts
        assert experts.w13.dtype == fp8.FP8 and experts.fp8_blocked == (strategy == "block")
    assert engine.model.lm_head.weight.dtype == torch.float32
    _assert_matches_hf(engine, hf, name)


def test_online_fp8_matches_a_per_channel_reference(tmp_path):
    """A float32 checkpoint served with quantization="fp8": each layer's weight quantized per
    output channel at load; the reference quantizes and dequantizes HF's weights in torch."""
    hf = _hf("llama", SMALL)
    hf.save_pretrained(str(tmp_path))
    engine = _engine(tmp_path, quantization="fp8")
    assert all(m.weight.dtype == fp8.FP8 and m.weight_scale.shape[1] == 1 for m in _fp8_layers(engine))
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.split(".")[-2] in fp8.CHECKPOINT_LAYERS:
                param.copy_(dequantize(*quantize(param, "channel")))
    _assert_matches_hf(engine, hf, "online fp8")


def test_online_fp8_moe_matches_a_per_channel_reference(tmp_path):
    """Qwen3-MoE with quantization="fp8": the experts' stacked w13 / w2 quantized per output
    channel too (HF's 3-D tensors [E, out, in] quantized per row of each expert in the
    reference); the router stays float32."""
    hf = _hf("qwen3_moe", SMALL)
    hf.save_pretrained(str(tmp_path))
    engine = _engine(tmp_path, quantization="fp8")
    experts = engine.model.layers[0].mlp.experts
    assert experts.w13.dtype == experts.w2.dtype == fp8.FP8 and experts.w13_scale.shape == (8, 64, 1)
    assert engine.model.layers[0].mlp.gate.weight.dtype == torch.float32
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if param.dim() == 3:  # experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]
                rows = param.reshape(-1, param.shape[-1])
                param.copy_(dequantize(*quantize(rows, "channel")).reshape(param.shape))
            elif name.split(".")[-2] in fp8.CHECKPOINT_LAYERS:
                param.copy_(dequantize(*quantize(param, "channel")))
    _assert_matches_hf(engine, hf, "online fp8, Qwen3-MoE")


def test_online_quantization_is_per_channel_and_keeps_zero_rows():
    w = torch.randn(8, 40) * torch.arange(1, 9).unsqueeze(1)
    w[3] = 0
    q, scale = fp8.quantize_per_channel(w)
    assert q.dtype == fp8.FP8 and scale.shape == (8, 1)
    torch.testing.assert_close(q.float().abs().amax(dim=1)[[0, 1, 2, 4]], torch.full((4,), 448.0))
    assert not q[3].float().any()
    rows = [0, 1, 2, 4, 5, 6, 7]  # the reference's zero row divides by a zero scale
    ref_q, ref_scale = quantize(w[rows], "channel")
    torch.testing.assert_close(fp8.dequantize(q, scale, blocked=False)[rows], dequantize(ref_q, ref_scale),
                               atol=0, rtol=0)


@pytest.mark.parametrize("config, field", [
    (compressed_tensors_config("group", None), "config_groups.group_0.weights.strategy"),
    ({**compressed_tensors_config("channel", None), "format": "pack-quantized"}, "format"),
    ({**compressed_tensors_config("channel", None), "kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
    (compressed_tensors_config("channel", {"num_bits": 8, "type": "int", "strategy": "token"}),
     "config_groups.group_0.input_activations"),
    (compressed_tensors_config("channel", {**DYNAMIC_TOKEN, "strategy": "group"}),
     "config_groups.group_0.input_activations.strategy"),
    ({**FP8_BLOCK_CONFIG, "fmt": "e5m2"}, "fmt"),
    ({**FP8_BLOCK_CONFIG, "weight_block_size": [64, 64]}, "weight_block_size"),
    ({**FP8_BLOCK_CONFIG, "activation_scheme": "per-head"}, "activation_scheme"),
    ({"quant_method": "awq", "bits": 4}, "quant_method"),
])
def test_unsupported_quantization_configs_are_refused_by_field(config, field):
    with pytest.raises(ValueError, match=f"quantization_config.{field} "):
        fp8.checkpoint_scheme(config)


def test_block_size_in_compressed_tensors_is_checked():
    config = compressed_tensors_config("block", None)
    config["config_groups"]["group_0"]["weights"]["block_structure"] = [64, 128]
    with pytest.raises(ValueError, match="weights.block_structure"):
        fp8.checkpoint_scheme(config)


def test_block_scaled_experts_whose_up_rows_are_off_a_block_are_refused(tmp_path):
    """SMALL's experts are 32 rows wide: up's rows would start mid-block in w13."""
    save_fp8_checkpoint(_hf("qwen3_moe", SMALL), tmp_path, "block", FP8_BLOCK_CONFIG, "weight_scale_inv")
    with pytest.raises(ValueError, match="experts.0.up_proj.weight_scale_inv': its rows start at row 32"):
        _engine(tmp_path)


@pytest.fixture(scope="module")
def channel_checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("fp8-channel")
    save_fp8_checkpoint(_hf("llama", SMALL), folder, "channel", compressed_tensors_config("channel", DYNAMIC_TOKEN))
    return folder


def _copy(folder: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(folder, tmp_path / "ckpt"))


BAD_TENSORS = {
    "model.layers.1.self_attn.k_proj.weight_scale": (torch.ones(32, 2), "k_proj.weight_scale' has shape"),
    "model.layers.0.mlp.up_proj.weight": (torch.ones(128, 64), "up_proj.weight' is torch.float32"),
    "model.layers.0.self_attn.q_proj.input_scale": (torch.ones(4), "q_proj.input_scale' must be one positive"),
    "model.layers.0.mlp.down_proj.weight_scale": (None, r"missing weights: \['layers.0.mlp.down_proj.weight_scale"),
    "model.embed_tokens.weight_scale": (torch.ones(1), "no FP8 layer 'embed_tokens'"),
    "model.layers.0.self_attn.o_proj.weight_zero_point": (torch.ones(1), "o_proj.weight_zero_point' is not zero"),
}


@pytest.mark.parametrize("tensor_name", sorted(BAD_TENSORS))
def test_bad_scale_layouts_are_refused_naming_the_tensor(tensor_name, channel_checkpoint, tmp_path):
    folder = _copy(channel_checkpoint, tmp_path)
    tensor, message = BAD_TENSORS[tensor_name]
    rewrite(folder, {tensor_name: tensor})
    with pytest.raises(ValueError, match=message):
        _engine(folder)


def test_block_scales_of_a_fused_part_off_a_block_are_refused(channel_checkpoint, tmp_path):
    """SMALL's q is 64 rows: k's block scales would start mid-block in qkv_proj."""
    folder = _copy(channel_checkpoint, tmp_path)
    scales = {f"model.layers.{i}.{part}.weight_scale": torch.ones(1, 1) for i in (0, 1) for part in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")}  # every layer of SMALL is one 128 x 128 block or less
    rewrite(folder, scales, config=compressed_tensors_config("block", None))
    with pytest.raises(ValueError, match="k_proj.weight_scale': its rows start at row 64 of the fused"):
        _engine(folder)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 256])
@pytest.mark.parametrize("blocked", [False, True])
def test_cuda_fp8_linear_paths_against_the_dequantized_product(rows, blocked):
    """fp8.linear on CUDA, bfloat16 x: kernels.gemv (1 row) and kernels.fp8_gemm (<= 16 rows,
    block scales) round once; cuBLASLt's scaled matmul (> 16 rows, per channel) also quantizes x per token to
    e4m3 (3 mantissa bits: each product off by up to 2**-4 relative, summed over K with
    random signs): within 3% of the output's scale."""
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(4096, 1024, generator=gen) * 0.02
    q, scale = quantize(w, "block" if blocked else "channel")
    x = torch.randn(rows, 1024, generator=gen).to(torch.bfloat16)
    ref = x.double() @ dequantize(q, scale).double().T
    out = fp8.linear(x.cuda(), q.cuda(), scale.float().cuda(), None, blocked).double().cpu()
    kernel = blocked or rows <= fp8.MAX_KERNEL_ROWS
    atol = ref.abs().max().item() * (2 ** -7 if kernel else 0.03)
    torch.testing.assert_close(out, ref, atol=atol, rtol=2 ** -7 if kernel else 0.03)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["ct-channel-dynamic", "fp8-block-deepseek"])
def test_cuda_fp8_checkpoint_matches_hf_dequantized(name, tmp_path):
    """The CUDA path (Triton kernels, CUDA graphs) in float32: as close to HF as the CPU's."""
    family, shape, strategy, config, scale_name, input_scales = CHECKPOINTS[name]
    hf = _hf(family, shape)
    save_fp8_checkpoint(hf, tmp_path, strategy, config, scale_name, input_scales)
    # A pool of its own size: the default takes most of the GPU, and an earlier case's engine still holds it.
    engine = Engine(EngineConfig(model=ModelConfig(source=str(tmp_path), device="cuda", dtype="float32"),
                                 cache=CacheConfig(num_blocks=256)))
    _assert_matches_hf(engine, hf, f"{name} on CUDA")


def _shard(folder: Path, rank: int, size: int):
    from pdserve.engine.models.parallel import ShardPlan, SingleRank, TensorParallel
    from pdserve.engine.models.weights import load_model, resolve_model

    files = resolve_model(ModelConfig(source=str(folder), device="cpu", dtype="float32"))
    tp = TensorParallel(ShardPlan.of(files.arch, rank, size), SingleRank())  # loading only: no collectives
    return load_model(files, 64, torch.device("cpu"), torch.float32, 0, tp)


def _weight(model, layer: str) -> torch.Tensor:
    module = model.get_submodule(layer)
    return fp8.dequantize(module.weight, module.weight_scale, module.fp8_blocked)


def test_tensor_parallel_shards_take_their_rows_and_columns_with_their_scales(channel_checkpoint):
    """Two ranks' shards of a per-channel checkpoint, dequantized, are the slices of one rank's:
    q/k/v and gate/up rows (scales sliced with them), o and down columns (every row's scale)."""
    whole, shards = _shard(channel_checkpoint, 0, 1), [_shard(channel_checkpoint, r, 2) for r in (0, 1)]
    attn, mlp = "layers.1.self_attn", "layers.1.mlp"
    q, kv, inter = 64, 32, 128  # SMALL: 4 heads of 16, 2 KV heads, intermediate 128
    qkv = _weight(whole, f"{attn}.qkv_proj").split([q, kv, kv])
    gate_up = _weight(whole, f"{mlp}.gate_up_proj").split([inter, inter])
    for rank, shard in enumerate(shards):
        parts = [p.chunk(2)[rank] for p in qkv]
        torch.testing.assert_close(_weight(shard, f"{attn}.qkv_proj"), torch.cat(parts), atol=0, rtol=0)
        parts = [p.chunk(2)[rank] for p in gate_up]
        torch.testing.assert_close(_weight(shard, f"{mlp}.gate_up_proj"), torch.cat(parts), atol=0, rtol=0)
        for layer in (f"{attn}.o_proj", f"{mlp}.down_proj"):
            torch.testing.assert_close(_weight(shard, layer), _weight(whole, layer).chunk(2, dim=1)[rank],
                                       atol=0, rtol=0)


def test_tensor_parallel_slices_off_a_scale_block_are_refused(tmp_path):
    """BLOCKED's k_proj is 128 rows: two ranks' halves would split a 128-row scale block."""
    save_fp8_checkpoint(_hf("qwen3", BLOCKED), tmp_path, "block", FP8_BLOCK_CONFIG, "weight_scale_inv")
    with pytest.raises(ValueError, match="k_proj.weight_scale_inv': this rank's slice starts at 64 along dim 0"):
        _shard(tmp_path, 1, 2)
