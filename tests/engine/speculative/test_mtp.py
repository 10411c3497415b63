"""MTP drafting (`SpecConfig.method` "mtp", issue 52) on a tiny random DeepSeek-V3 whose
checkpoint the test gives a multi-token-prediction layer as `model.layers.{N}.*`: there is
no HF reference for MTP, so the layer is made a good drafter on purpose (a copy of the one
decoder layer, `eh_proj` reading the token's embedding plus a little of the hidden state,
embeddings of RMS 1 so that the MTP layer's input norm changes nothing), and the output
must equal the engine's without speculation: lossless, under continuous batching, K = 1
and 3. Disaggregated (a prefill engine's held KV copied into a decode engine's reserved
blocks, the MTP layer's part with it, and the hidden state the delta carries) a request
accepts as many drafts as colocated.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from pdserve.engine.engine import Engine
from pdserve.engine.messages import WorkerRequest
from pdserve.engine.sampling import SamplingParams
from tests.engine.test_deepseek import _hf_model, v3

HIDDEN = 64  # TINY's hidden_size
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 250, (n,), generator=gen).tolist() for n in (5, 19, 40)]


def mtp_tensors(tensors: dict[str, torch.Tensor], num_layers: int, hidden_weight: float) -> dict[str, torch.Tensor]:
    """The MTP layer of a checkpoint of `num_layers` layers (`tensors`), as
    `model.layers.{num_layers}.*`: the last layer's tensors (FP8 ones and their scales as
    they are), the norms, eh_proj = [I | hidden_weight * R], and copies of the embedding and
    the LM head."""
    gen = torch.Generator().manual_seed(11)
    last, mtp_prefix = f"model.layers.{num_layers - 1}.", f"model.layers.{num_layers}."
    mtp = {mtp_prefix + name.removeprefix(last): t.clone() for name, t in tensors.items() if name.startswith(last)}
    hidden = tensors["model.norm.weight"].shape[0]
    mix = torch.randn(hidden, hidden, generator=gen) / hidden ** 0.5
    own = {"enorm.weight": torch.ones(hidden), "hnorm.weight": torch.ones(hidden),
           "eh_proj.weight": torch.cat((torch.eye(hidden), hidden_weight * mix), dim=1),
           "shared_head.norm.weight": tensors["model.norm.weight"].clone(),
           "shared_head.head.weight": tensors["lm_head.weight"].clone(),
           "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone()}
    return mtp | {mtp_prefix + name: t for name, t in own.items()}


def with_mtp_layer(hf, folder: Path, hidden_weight: float = 0.05) -> Path:
    """`hf` (its embeddings scaled to RMS 1: see the module's docstring) saved to `folder`
    with an MTP layer made of its last layer."""
    from safetensors.torch import load_file, save_file

    emb = hf.model.embed_tokens.weight
    with torch.no_grad():
        emb.div_(emb.pow(2).mean(-1, keepdim=True).sqrt())
    hf.save_pretrained(str(folder))
    tensors = load_file(str(folder / "model.safetensors"))
    save_file(tensors | mtp_tensors(tensors, hf.config.num_hidden_layers, hidden_weight),
              str(folder / "model.safetensors"))
    return folder


def _hf(**overrides):
    return _hf_model(v3(num_hidden_layers=1, first_k_dense_replace=0, num_nextn_predict_layers=1, **overrides))


def write_mtp_checkpoint(folder: Path, hidden_weight: float = 0.05) -> Path:
    """A one-layer V3 with an MTP layer (see the module's docstring), saved to `folder`."""
    return with_mtp_layer(_hf(), folder, hidden_weight)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_mtp_checkpoint(tmp_path_factory.mktemp("v3-mtp"))


def _engine(folder: Path, spec: SpecConfig | None = None, **overrides) -> Engine:
    overrides.setdefault("cache", CacheConfig(num_blocks=24))
    return Engine(EngineConfig(model=ModelConfig(source=str(folder), device="cpu", dtype="float32"),
                               spec=spec or SpecConfig(), **overrides))


def _run(engine: Engine, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    ids = [engine.add_request(p, params) for p in prompts]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished:
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.token_ids)
    return [tokens[i] for i in ids]


def _mtp(k: int) -> SpecConfig:
    return SpecConfig(method="mtp", num_speculative_tokens=k)


@pytest.fixture(scope="module")
def baseline(folder) -> list[list[int]]:
    return _run(_engine(folder), _prompts())


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_speculation_is_lossless_under_continuous_batching(folder, baseline, k):
    # Chunks of 16 tokens: the longer prompts' MTP entries are written chunk after chunk.
    engine = _engine(folder, _mtp(k), scheduler=SchedulerConfig(max_num_batched_tokens=16))
    assert engine.pool.layout.num_layers == 2  # the decoder's layer and the MTP layer's
    assert _run(engine, _prompts()) == baseline
    metrics = engine.speculator.metrics
    assert metrics.num_proposed > 0
    # A drafter this close to the target is mostly right; a broken one (wrong KV, wrong
    # hidden state, wrong position) is mostly wrong.
    assert metrics.acceptance_rate > 0.5, (metrics.num_accepted, metrics.num_proposed)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_sampled_requests_speculate_with_mtp_too(folder):
    engine = _engine(folder, _mtp(3))
    params = SamplingParams(temperature=0.8, max_tokens=12, seed=5, ignore_eos=True)
    out = _run(engine, _prompts(), params)
    assert [len(t) for t in out] == [12] * 3
    assert engine.speculator.metrics.num_accepted > 0


def _colocated(folder: Path, prompt: list[int]) -> tuple[list[int], int]:
    engine = _engine(folder, _mtp(3))
    tokens = _run(engine, [prompt])[0]
    return tokens, engine.speculator.metrics.num_accepted


def _disaggregated(folder: Path, prompt: list[int], carry_state: bool = True) -> tuple[list[int], int, Engine]:
    prefill, decode = _engine(folder, _mtp(3)), _engine(folder, _mtp(3))
    rid = prefill.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1), hold_kv=True)
    deltas = []
    while prefill.has_unfinished:
        deltas.extend(prefill.step())
    [delta] = deltas
    assert delta.held_block_ids and len(delta.held_draft_state) == HIDDEN * 4  # one float32 hidden state
    dst = decode.reserve(WorkerRequest("received", tuple(prompt), GREEDY))
    decode.pool.kv[:, :, dst] = prefill.pool.kv[:, :, list(delta.held_block_ids)]  # both layers' latents
    prefill.release(rid)
    decode.admit_prefilled("received", delta.token_ids[0], draft_state=delta.held_draft_state if carry_state else b"")
    tokens = [delta.token_ids[0]]
    while decode.has_unfinished:
        for d in decode.step():
            tokens.extend(d.token_ids)
    return tokens, decode.speculator.metrics.num_accepted, decode


def test_a_request_accepts_as_many_drafts_disaggregated_as_colocated(folder):
    for prompt in _prompts():
        want, accepted = _colocated(folder, prompt)
        got, got_accepted, decode = _disaggregated(folder, prompt)
        assert got == want, len(prompt)
        assert accepted > 0 and got_accepted == accepted, (len(prompt), got_accepted, accepted)
        assert decode.block_manager.num_free_blocks == decode.block_manager.num_blocks


def test_without_the_hidden_state_the_decode_worker_drafts_differently(tmp_path):
    """The control for the test above: the hidden state that crosses matters. With eh_proj
    reading more of the hidden state, a decode worker that starts from zeros drafts otherwise
    for some request (its tokens stay the target's)."""
    folder = write_mtp_checkpoint(tmp_path, hidden_weight=0.1)
    counts = set()
    for prompt in _prompts():
        got, with_state, _ = _disaggregated(folder, prompt)
        lost, without_state, _ = _disaggregated(folder, prompt, carry_state=False)
        assert got == lost
        counts.add(without_state != with_state)
    assert True in counts, "dropping the hidden state changed no request's acceptance"


def test_mtp_weights_load_when_asked_and_are_skipped_otherwise(folder):
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "model.safetensors"))
    with_mtp = _engine(folder, _mtp(2))
    assert with_mtp.model.mtp is not None
    torch.testing.assert_close(with_mtp.model.mtp.eh_proj.weight, tensors["model.layers.1.eh_proj.weight"])
    torch.testing.assert_close(with_mtp.model.mtp.layer.self_attn.kv_b_proj.weight,
                               tensors["model.layers.1.self_attn.kv_b_proj.weight"])
    without = _engine(folder)
    assert without.model.mtp is None and without.pool.layout.num_layers == 1
    # A worker built with the MTP layer and one without hold different KV: their layouts differ by name.
    assert with_mtp.pool.layout.model != without.pool.layout.model


def test_an_fp8_block_scaled_mtp_layer_loads_like_the_rest(tmp_path):
    from safetensors.torch import load_file, save_file

    from tests.engine import fp8_checkpoints as fp8c

    hf = _hf(intermediate_size=128, moe_intermediate_size=128)
    emb = hf.model.embed_tokens.weight
    with torch.no_grad():
        emb.div_(emb.pow(2).mean(-1, keepdim=True).sqrt())
    layers = (*fp8c.LAYERS, "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
    fp8c.save_fp8_checkpoint(hf, tmp_path, "block", fp8c.FP8_BLOCK_CONFIG, "weight_scale_inv", layers=layers)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    save_file(tensors | mtp_tensors(tensors, 1, 0.05), str(tmp_path / "model.safetensors"))
    engine = _engine(tmp_path, _mtp(3))
    assert engine.model.mtp.layer.self_attn.kv_b_proj.weight.dtype == torch.float8_e4m3fn
    # The MTP layer is layer 0's copy: every parameter (FP8 weights, their block scales) alike.
    layer0 = dict(engine.model.layers[0].named_parameters())
    for name, param in engine.model.mtp.layer.named_parameters():
        want = layer0[name]
        assert param.dtype == want.dtype and torch.equal(param.view(torch.uint8), want.view(torch.uint8)), name
    assert _run(engine, _prompts()[:2]) == _run(_engine(tmp_path), _prompts()[:2])
    assert engine.speculator.metrics.acceptance_rate > 0.3


def test_a_model_without_mtp_layers_is_refused(tmp_path, folder):
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 0}))
    (tmp_path / "model.safetensors").symlink_to(folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"has no multi-token-prediction layers .*model\.layers\.1\.\*"):
        _engine(tmp_path, _mtp(2))
    # One that says it has one but does not hold its weights: the load names the layer.
    (tmp_path / "model.safetensors").unlink()
    _hf().save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match=r"MTP layer \(model\.layers\.1\.\*\) is missing or incomplete"):
        _engine(tmp_path, _mtp(2))
    with pytest.raises(ValueError, match="needs a DeepSeek-V3-style checkpoint.*a llama model has none"):
        Engine(EngineConfig(model=ModelConfig(source="dummy:tiny", device="cpu", dtype="float32"), spec=_mtp(2)))
    # An engine built without it cannot start drafting with it: the pool has no layer for its KV.
    plain = _engine(folder)
    with pytest.raises(ValueError, match="needs the engine built with the model's MTP layer"):
        plain.speculate(_mtp(2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_mtp_speculation_is_lossless(tmp_path):
    """On CUDA (the MLA kernels; with an MTP layer every step eager, the engine without it
    replaying its decodes from graphs) the output is the engine's without speculation, and
    the drafter still mostly right (rotary and value widths of 16: the kernels' smallest)."""
    folder = with_mtp_layer(_hf(qk_rope_head_dim=16, v_head_dim=16), tmp_path)

    def cuda_engine(spec: SpecConfig | None = None) -> Engine:
        return Engine(EngineConfig(model=ModelConfig(source=str(folder), device="cuda", dtype="float32"),
                                   cache=CacheConfig(num_blocks=24), spec=spec or SpecConfig()))

    torch.backends.cuda.matmul.allow_tf32 = False
    want = _run(cuda_engine(), _prompts())
    engine = cuda_engine(_mtp(3))
    assert _run(engine, _prompts()) == want
    assert engine.speculator.metrics.acceptance_rate > 0.5
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
