"""Command-line flags made from the config dataclasses: one per field, `--<path>`
(`--server.port`, `--engine.model.source`), typed by its annotation, its help and default
taken from the field. A flag's value is checked by the config itself, as a file's is: a
bad one is the config's one-line error, naming the flag."""

from __future__ import annotations

import argparse
import inspect
import types
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from pdserve.cluster.settings.config_tree import ConfigField, with_values
from pdserve.engine.config import EngineConfig

# The spellings the flags had before they were made from the configs: kept beside --<path>
# (scripts, the docs and the Helm chart use them).
ALIASES: dict[str, str] = {
    "engine.model.source": "--model",
    "engine.model.device": "--device",
    "engine.model.dtype": "--dtype",
    "engine.model.max_model_len": "--max-model-len",
    "engine.model.quantization": "--quantization",
    "engine.cache.num_blocks": "--num-kv-blocks",
    "engine.cache.kv_cache_dtype": "--kv-cache-dtype",
    "engine.kv_tiers.host_bytes": "--kv-host-bytes",
    "engine.kv_tiers.disk_dir": "--kv-disk-dir",
    "engine.kv_tiers.disk_bytes": "--kv-disk-bytes",
    "engine.scheduler.max_num_batched_tokens": "--max-num-batched-tokens",
    "engine.scheduler.max_num_seqs": "--max-num-seqs",
    "engine.parallel.tensor_parallel_size": "--tensor-parallel-size",
    "engine.spec.method": "--spec-method",
    "engine.spec.num_speculative_tokens": "--num-speculative-tokens",
    "engine.spec.draft_model": "--draft-model",
    "engine.spec.draft_vocab_size": "--draft-vocab-size",
    "engine.spec.draft_vocab_file": "--draft-vocab-file",
    "ray.address": "--address",
    "server.host": "--host",
    "server.port": "--port",
    "server.http": "--no-http",
    "server.http_port": "--http-port",
    "server.metrics_port": "--metrics-port",
    "server.tls_cert": "--tls-cert",
    "server.tls_key": "--tls-key",
    "server.tls_client_ca": "--tls-client-ca",
    "server.api_key_file": "--api-key-file",
    "server.admin_token_file": "--admin-token-file",
    "server.chat_template": "--chat-template",
    "server.tool_call_parser": "--tool-call-parser",
    "server.tool_format_fallback": "--tool-format-fallback",
    "server.tenants_file": "--tenants-file",
    "server.frontends": "--frontends",
    "server.control_plane": "--control-plane",
    "ray.namespace": "--namespace",
    "pools.mode": "--mode",
    "pools.num_prefill": "--num-prefill",
    "pools.num_decode": "--num-decode",
    "pools.gpus_per_worker": "--gpus-per-worker",
    "pools.prefill_tp": "--prefill-tp",
    "pools.decode_tp": "--decode-tp",
    "pools.routing": "--routing",
    "admission.max_waiting_per_worker": "--max-waiting-per-worker",
    "admission.retry_after_s": "--retry-after-s",
    "coordinator.max_migrations": "--max-migrations",
    "coordinator.migration_wait_s": "--migration-wait-s",
    "kv_transport.transfer_timeout_s": "--transfer-timeout-s",
    "kv_transport.require": "--kv-require",
    "health.interval_s": "--health-interval-s",
    "health.ping_timeout_s": "--ping-timeout-s",
    "health.unresponsive_after_s": "--unresponsive-after-s",
    "health.stuck_after_s": "--stuck-after-s",
}
_GIVEN = "config_flags"  # Namespace attribute: {path: (value, the flag that gave it)}


def shown(value: Any) -> str:
    """A default as a flag would spell it."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, frozenset):
        return ",".join(sorted(value))
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value) if value != "" else "''"


def _converter(kind: Any) -> Callable[[str], Any]:
    """Text to a value of the annotation `kind`; its name is what argparse calls a bad one."""
    args = typing.get_args(kind)
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        inner = _converter(next(a for a in args if a is not type(None)))

        def optional(text: str) -> Any:
            return None if text.lower() in ("none", "null") else inner(text)

        optional.__name__ = f"{inner.__name__} (or none)"
        return optional
    if typing.get_origin(kind) in (frozenset, tuple, list):
        item, collection = _converter(args[0]), typing.get_origin(kind)

        def items(text: str) -> Any:
            return collection(item(t.strip()) for t in text.split(",") if t.strip())

        items.__name__ = f"comma-separated {item.__name__}"
        return items
    if kind in (str, int, float, Path):
        return kind
    raise TypeError(f"no flag type for {kind!r}: teach cluster/settings/flags.py")


class _SetField(argparse.Action):
    """Records a config field's value and the flag that gave it (unset flags record nothing)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if self.nargs == 0:  # a bool: --x, or --no-x
            values = not (option_string or "").startswith("--no-")
        given = namespace.__dict__.setdefault(_GIVEN, {})
        given[self.dest] = (values, option_string)


def add_config_flags(parser: argparse.ArgumentParser, fields: Iterable[ConfigField]) -> None:
    """A flag for each of `fields`, in one argument group per section."""
    groups: dict[str, Any] = {}
    for f in fields:
        section = f.path.rpartition(".")[0]
        if section not in groups:
            summary = " ".join(inspect.cleandoc(f.section.__doc__ or "").split("\n\n")[0].split())
            groups[section] = parser.add_argument_group(f"{section} ({f.section.__name__})", summary)
        names = [f"--{f.path}"]
        alias = ALIASES.get(f.path)
        help_text = f"{f.doc} (default: {shown(f.default)})".replace("%", "%%")
        if f.kind is bool:
            names.append(f"--no-{f.path}")
            names += [alias] if alias else []
            groups[section].add_argument(*names, dest=f.path, action=_SetField, nargs=0,
                                         default=argparse.SUPPRESS, help=help_text)
            continue
        names += [alias] if alias else []
        groups[section].add_argument(*names, dest=f.path, action=_SetField, type=_converter(f.kind),
                                     default=argparse.SUPPRESS, metavar=f.name.upper(), help=help_text)


def given_values(args: argparse.Namespace) -> dict[str, Any]:
    """{path: value} of the config flags given."""
    return {path: value for path, (value, _) in getattr(args, _GIVEN, {}).items()}


def apply_flags(config: Any, args: argparse.Namespace, prefix: str = "") -> Any:
    """`config` with the config flags given replaced (`prefix`: where `config` sits in the
    serve config, e.g. "engine."); a bad value is a ValueError naming the flag that gave it."""
    given = getattr(args, _GIVEN, {})
    values = {path.removeprefix(prefix): value for path, (value, _) in given.items()}
    return with_values(config, values, lambda path: given[prefix + path][1])


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The engine config of `pdserve generate` and `pdserve profile`: the defaults and their
    engine.* flags."""
    return apply_flags(EngineConfig(), args, "engine.")
