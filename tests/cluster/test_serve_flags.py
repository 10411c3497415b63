"""`pdserve serve`'s flags are made from the config dataclasses: one per field, typed, its
help and default the field's, checked by the config itself."""

from __future__ import annotations

import argparse
import functools
from pathlib import Path
from typing import Any

import pytest

from pdserve.cluster.cli import build_parser, main
from pdserve.cluster.settings.config import ServeConfig
from pdserve.cluster.settings.config_tree import config_fields, with_values
from pdserve.cluster.settings.flags import ALIASES, apply_flags, given_values, shown


@functools.cache
def serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def field_actions() -> dict[str, argparse.Action]:
    paths = {f.path for f in config_fields()}
    return {a.dest: a for a in serve_parser()._actions if a.dest in paths}


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def served(*argv: str, config: ServeConfig | None = None) -> ServeConfig:
    return apply_flags(config or ServeConfig(), parse(*argv))


def value_at(config: Any, path: str) -> Any:
    return functools.reduce(getattr, path.split("."), config)


def test_every_config_field_has_a_flag_with_its_doc_and_no_choices() -> None:
    actions = field_actions()
    assert sorted(actions) == sorted(f.path for f in config_fields())
    for f in config_fields():
        action = actions[f.path]
        assert f"--{f.path}" in action.option_strings
        assert f.doc, f"{f.section.__name__}'s docstring does not describe {f.name}"
        assert action.help.startswith(f.doc.replace("%", "%%"))
        assert action.choices is None  # the config refuses a bad value, in its own words
    for path, alias in ALIASES.items():
        assert alias in actions[path].option_strings


@pytest.mark.parametrize("field", config_fields(), ids=lambda f: f.path)
def test_a_flag_given_its_default_parses_back_to_it(field) -> None:
    if field.kind is bool:
        argv = [f"--{field.path}" if field.default else f"--no-{field.path}"]
    else:
        argv = [f"--{field.path}", shown(field.default) if field.default != "" else ""]
    args = parse(*argv)
    assert given_values(args) == {field.path: field.default}
    assert served(*argv) == ServeConfig()


@pytest.mark.parametrize("argv, path, want", [
    (["--port", "6000"], "server.port", 6000),
    (["--server.port", "6000"], "server.port", 6000),
    (["--no-http"], "server.http", False),
    (["--no-server.http"], "server.http", False),
    (["--router.kv_usage_weight", "0.5"], "router.kv_usage_weight", 0.5),
    (["--loop.idle_wait_s", "0.01"], "loop.idle_wait_s", 0.01),
    (["--health.start_timeout_s", "30"], "health.start_timeout_s", 30.0),
    (["--health.start_attempts", "5"], "health.start_attempts", 5),
    (["--worker.delta_wait_s", "2"], "worker.delta_wait_s", 2.0),
    (["--coordinator.poll_wait_s", "0.1"], "coordinator.poll_wait_s", 0.1),
    (["--engine.cache.kv_copy_wait_s", "3"], "engine.cache.kv_copy_wait_s", 3.0),
    (["--model", "dummy:tiny"], "engine.model.source", "dummy:tiny"),
    (["--engine.model.cache_dir", "/tmp/c"], "engine.model.cache_dir", Path("/tmp/c")),
    (["--engine.model.enforce_eager"], "engine.model.enforce_eager", True),
    (["--quantization", "fp8"], "engine.model.quantization", "fp8"),
    (["--gpus-per-worker", "0.5"], "pools.gpus_per_worker", 0.5),
    (["--address", "auto"], "ray.address", "auto"),
    (["--kv-require", "rdma"], "kv_transport.require", "rdma"),
    (["--kv_transport.allowed_transports", "cuda_ipc, tcp"], "kv_transport.allowed_transports",
     frozenset({"cuda_ipc", "tcp"})),
    (["--kv_transport.progress_mode", "blocking"], "kv_transport.progress_mode", "blocking"),
])
def test_a_flag_sets_its_field(argv, path, want) -> None:
    config = served(*argv)
    assert value_at(config, path) == want
    assert config == with_values(ServeConfig(), {path: want})  # and nothing else


def test_none_unsets_an_optional_field_the_file_set(tmp_path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("engine: {model: {max_model_len: 512}}\nray: {address: auto}\nserver: {port: 6000}\n")
    from pdserve.cluster.settings.config import load_config

    config = served("--max-model-len", "none", "--ray.address", "None", config=load_config(f))
    assert config.engine.model.max_model_len is None and config.ray.address is None
    assert config.server.port == 6000  # a field no flag names keeps the file's value


def test_flags_override_the_file_which_overrides_the_defaults(tmp_path, monkeypatch, capsys) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("server: {port: 6000, http_port: 6001}\nrouter: {prompt_weight: 2}\n")
    assert main(["serve", "--config", str(f), "--check-config", "--http-port", "7001"]) == 0
    out = capsys.readouterr().out
    assert "port=6000" in out and "http_port=7001" in out and "prompt_weight=2" in out
    assert "metrics_port=9400" in out  # the default


@pytest.mark.parametrize("argv, message", [
    (["--mode", "mixed"], "--mode: PoolConfig.mode must be one of ('disaggregated', 'colocated'), got 'mixed'"),
    (["--pools.mode", "mixed", "--num-decode", "2"], "--pools.mode: PoolConfig.mode must be one of"),
    (["--health.start_attempts", "0"], "--health.start_attempts: HealthConfig.start_attempts must be > 0"),
    (["--tls-key", "k.pem"], "--tls-key: ServerConfig.tls_cert and tls_key go together"),
    (["--kv_transport.progress_mode", "busy"], "--kv_transport.progress_mode: kv_transport.progress_mode must be"),
    (["--engine.cache.kv_copy_wait_s", "0"], "--engine.cache.kv_copy_wait_s: CacheConfig.kv_copy_wait_s must be > 0"),
    (["--spec-method", "ngram", "--tensor-parallel-size", "2"],
     "--tensor-parallel-size: speculative decoding with tensor_parallel_size > 1 is not supported yet"),
    (["--spec-method", "mtp", "--num-speculative-tokens", "0", "--tensor-parallel-size", "2"],
     "--tensor-parallel-size: speculative decoding with tensor_parallel_size > 1 is not supported yet"),
    (["--spec-method", "eagle"], "--spec-method: SpecConfig.method must be one of ('none', 'draft_model', "
                                  "'self_draft', 'ngram', 'mtp'), got 'eagle'"),
])
def test_a_bad_value_is_the_configs_error_naming_the_flag(argv, message, capsys) -> None:
    assert main(["serve", "--check-config", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pdserve: error: {message}") and "Traceback" not in err


@pytest.mark.parametrize("argv, words", [
    (["--server.port", "abc"], "argument --server.port/--port: invalid int value: 'abc'"),
    (["--max-model-len", "long"], "argument --engine.model.max_model_len/--max-model-len: invalid int (or none) value"),
])
def test_a_value_of_the_wrong_type_names_the_flag(argv, words, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse(*argv)
    assert exit_.value.code == 2 and words in capsys.readouterr().err


def test_help_shows_each_default_taken_from_the_config(monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "100000")  # one line per flag's help: nothing wraps
    text = " ".join(serve_parser().format_help().split())
    defaults = ServeConfig()
    actions = field_actions()
    for f in config_fields():
        help_text = actions[f.path].help.replace("%%", "%")
        assert help_text.endswith(f"(default: {shown(value_at(defaults, f.path))})"), f.path
        assert " ".join(help_text.split()) in text, f.path


def test_generate_takes_the_engine_flags() -> None:
    from pdserve.cluster.settings.flags import engine_config_from_args

    args = build_parser().parse_args(["generate", "--model", "dummy:tiny", "--engine.spec.method", "ngram", "hi"])
    config = engine_config_from_args(args)
    assert config.model.source == "dummy:tiny" and config.spec.method == "ngram"
    args = build_parser().parse_args(["generate", "--model", "dummy:tiny", "--spec-method", "mtp", "hi"])
    assert engine_config_from_args(args).spec.method == "mtp"
    assert config.cache == ServeConfig().engine.cache
