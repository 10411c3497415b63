"""ServeConfig: YAML loading, overrides, and fitting pools to the GPUs there are."""

from __future__ import annotations

import pytest

from pdserve.cluster.settings.config import config_from_dict, load_config
from pdserve.cluster.settings.config_tree import with_values
from pdserve.cluster.settings.pool_config import PoolConfig, fit_pools_to_gpus


def test_yaml_sections_build_the_same_objects_as_flags(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("engine:\n  model: {source: dummy:tiny, device: cpu}\n  spec: {method: ngram}\n"
                 "server: {port: 6000}\npools: {mode: colocated, num_decode: 2}\n")
    config = load_config(f)
    assert config.engine.model.source == "dummy:tiny" and config.engine.spec.method == "ngram"
    assert config.server.port == 6000 and config.server.host == "127.0.0.1"
    assert config.pools == PoolConfig(mode="colocated", num_decode=2)
    assert with_values(config, {"server.port": 7000}).server.port == 7000


@pytest.mark.parametrize("data, words", [
    ({"pools": {"num_decode": 0}}, "needs >= 1 decode worker"),
    ({"pools": {"mode": "mixed-up"}}, "PoolConfig.mode"),
    ({"server": {"prot": 1}}, "unknown keys in config section 'server'"),
    ({"server": {"http_port": 70000}}, "http_port=70000"),
    ({"server": {"http": "no"}}, "http must be true or false"),
    ({"engine": {"model": {"dtype": "int3"}}}, "ModelConfig.dtype"),
    ({"routers": {}}, "unknown config sections"),
    ({"kv_transport": {"direct_writes": "no"}}, "direct_writes must be true or false"),
    ({"server": {"tls_cert": "cert.pem"}}, "tls_cert and tls_key go together"),
    ({"coordinator": {"max_migrations": -1}}, "max_migrations must be >= 0"),
    ({"kv_transport": {"require": "nvlink"}}, "kv_transport.require must be 'any' or one of"),
    ({"kv_transport": {"require": "cuda_ipc", "allowed_transports": ["shm", "tcp"]}}, "leaves none of"),
    ({"kv_transport": {"allowed_transports": ["ib"]}}, "allowed_transports must be some of"),
    ({"loop": {"idle_wait_s": 0}}, "LoopConfig.idle_wait_s must be > 0"),
    ({"loop": {"idle": 1}}, "unknown keys in config section 'loop'"),
    ({"server": {"shutdown_grace_s": -1}}, "shutdown_grace_s must be >= 0"),
    ({"pools": {"actor_max_concurrency": 0}}, "actor_max_concurrency must be >= 1"),
])
def test_bad_config_is_a_clear_value_error(data, words):
    with pytest.raises(ValueError, match=words):
        config_from_dict(data)


@pytest.mark.parametrize("gpus, want", [
    (0, PoolConfig(gpus_per_worker=0.0)),
    (1, PoolConfig(mode="colocated", num_decode=1, gpus_per_worker=1.0)),
    (2, PoolConfig(gpus_per_worker=1.0)),
    (8, PoolConfig(gpus_per_worker=1.0)),
])
def test_pools_fit_the_gpus(gpus, want):
    assert fit_pools_to_gpus(PoolConfig(), gpus) == want


@pytest.mark.parametrize("gpus, tp, want", [
    (4, 2, PoolConfig(decode_tp=2, prefill_tp=1, gpus_per_worker=1.0)),  # 1 + 2 GPUs fit in 4
    (2, 2, PoolConfig(mode="colocated", num_decode=1, decode_tp=2, prefill_tp=1, gpus_per_worker=1.0)),
    (8, 4, PoolConfig(mode="colocated", num_decode=2, decode_tp=4, prefill_tp=4, num_prefill=2,
                      gpus_per_worker=1.0)),  # 2 x 4 + 1 x 4 do not fit in 8: two mixed workers of 4
])
def test_pools_fit_the_gpus_of_tensor_parallel_workers(gpus, tp, want):
    pools = PoolConfig(decode_tp=tp, prefill_tp=want.prefill_tp, num_prefill=want.num_prefill)
    assert fit_pools_to_gpus(pools, gpus) == want


def test_tensor_parallel_size_reaches_each_pools_engine():
    config = config_from_dict({"engine": {"parallel": {"tensor_parallel_size": 2}}, "pools": {"mode": "colocated"}})
    assert config.engine_for("decode").parallel.tensor_parallel_size == 2
    config = config_from_dict({"pools": {"mode": "colocated", "decode_tp": 3}})
    assert config.engine_for("decode").parallel.tensor_parallel_size == 3
    assert config.engine_for("prefill").parallel.tensor_parallel_size == 1


def test_a_prefill_worker_drafts_nothing_but_builds_the_mtp_layer_its_decode_workers_draft_with():
    config = config_from_dict({"engine": {"spec": {"method": "ngram", "num_speculative_tokens": 3}}})
    assert config.engine_for("prefill").spec.method == "none"
    config = config_from_dict({"engine": {"spec": {"method": "mtp", "num_speculative_tokens": 3}}})
    decode, prefill = config.engine_for("decode").spec, config.engine_for("prefill").spec
    assert decode.method == "mtp" and decode.enabled and decode.num_speculative_tokens == 3
    # The prompt's MTP KV is computed on the prefill worker (runner/mtp_carry.py): the layer is built there.
    assert prefill.method == "mtp" and not prefill.enabled


@pytest.mark.parametrize("data, words", [
    ({"pools": {"decode_tp": 0}}, "decode_tp must be >= 1"),
    ({"engine": {"parallel": {"tensor_parallel_size": 0}}}, "tensor_parallel_size must be >= 1"),
    ({"engine": {"parallel": {"collective_timeout_s": 0}}}, "collective_timeout_s must be > 0"),
])
def test_bad_parallel_settings_are_clear_value_errors(data, words):
    with pytest.raises(ValueError, match=words):
        config_from_dict(data)


def test_a_tensor_parallel_size_the_model_cannot_split_fails_before_any_worker_starts():
    import asyncio

    from pdserve.cluster.server import start_server

    config = config_from_dict({"engine": {"model": {"device": "cpu"}}, "pools": {"mode": "colocated", "decode_tp": 2}})
    with pytest.raises(ValueError, match="does not divide the model's 9 attention heads"):
        asyncio.run(start_server(config))  # the default model: 9 heads, 3 KV heads


def test_explicit_gpus_per_worker_is_kept():
    pools = PoolConfig(gpus_per_worker=0.5)
    assert fit_pools_to_gpus(pools, 1) is pools


def test_client_auth_reads_the_files_and_the_env(tmp_path, monkeypatch):
    from pdserve.cluster.settings.config import API_KEY_ENV, ServerConfig
    from pdserve.cluster.settings.secrets import client_auth

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert client_auth(ServerConfig()).api_key is None and not client_auth(ServerConfig()).tls
    monkeypatch.setenv(API_KEY_ENV, "from-the-env")
    assert client_auth(ServerConfig()).api_key == "from-the-env"
    token = tmp_path / "token"
    token.write_text("from-a-file\n")
    auth = client_auth(ServerConfig(api_key_file=str(token)))
    assert auth.api_key == "from-a-file" and "from-a-file" not in repr(auth)
    with pytest.raises(ValueError, match="cannot read the TLS certificate"):
        client_auth(ServerConfig(tls_cert=str(tmp_path / "none.pem"), tls_key=str(token)))
    (tmp_path / "empty").write_text("")
    with pytest.raises(ValueError, match="is empty"):
        client_auth(ServerConfig(api_key_file=str(tmp_path / "empty")))


@pytest.mark.parametrize("require, allowed, want", [
    ("any", ("cuda_ipc", "rdma", "shm", "tcp"), {"cuda_ipc", "rdma", "shm", "tcp"}),
    ("cuda_ipc", ("cuda_ipc", "rdma", "shm", "tcp"), {"cuda_ipc"}),
    ("rdma", ("cuda_ipc", "rdma", "shm", "tcp"), {"cuda_ipc", "rdma"}),
    ("shm", ("rdma", "shm", "tcp"), {"rdma", "shm"}),
    ("tcp", ("tcp",), {"tcp"}),
    ("any", ("shm",), {"shm"}),
])
def test_require_is_the_slowest_transport_a_pair_may_use(require, allowed, want):
    config = config_from_dict({"kv_transport": {"require": require, "allowed_transports": list(allowed)}})
    assert config.kv_transport.transports == want


def test_the_loop_and_shutdown_settings_come_from_the_file(tmp_path):
    from pdserve.engine.loop import LoopConfig

    f = tmp_path / "c.yaml"
    f.write_text("loop: {idle_wait_s: 0.01, stop_timeout_s: 3}\nserver: {shutdown_grace_s: 0.5}\n"
                 "kv_transport: {require: rdma}\n")
    config = load_config(f)
    assert config.loop == LoopConfig(idle_wait_s=0.01, stop_timeout_s=3.0)
    assert config.server.shutdown_grace_s == 0.5 and config.kv_transport.require == "rdma"
