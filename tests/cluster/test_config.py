"""ServeConfig: YAML loading, overrides, and fitting pools to the GPUs there are."""

from __future__ import annotations

import pytest

from pdserve.cluster.config import PoolConfig, config_from_dict, fit_pools_to_gpus, load_config, with_overrides


def test_yaml_sections_build_the_same_objects_as_flags(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("engine:\n  model: {source: dummy:tiny, device: cpu}\n  spec: {method: ngram}\n"
                 "server: {port: 6000}\npools: {mode: colocated, num_decode: 2}\n")
    config = load_config(f)
    assert config.engine.model.source == "dummy:tiny" and config.engine.spec.method == "ngram"
    assert config.server.port == 6000 and config.server.host == "127.0.0.1"
    assert config.pools == PoolConfig(mode="colocated", num_decode=2)
    assert with_overrides(config, server={"port": 7000, "host": None}).server.port == 7000


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


def test_explicit_gpus_per_worker_is_kept():
    pools = PoolConfig(gpus_per_worker=0.5)
    assert fit_pools_to_gpus(pools, 1) is pools


def test_client_auth_reads_the_files_and_the_env(tmp_path, monkeypatch):
    from pdserve.cluster.config import API_KEY_ENV, ServerConfig, client_auth

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
