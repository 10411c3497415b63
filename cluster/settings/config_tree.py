"""The serve config as a tree of fields: every leaf field with its type, default and docstring
entry (`config_fields`: what `pdserve serve`'s flags and the Helm values schema test are made
from), and replacing fields by dotted path (`with_values`: what the flags apply)."""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pdserve.cluster.settings.config import ServeConfig


@dataclass(frozen=True, slots=True)
class ConfigField:
    """One leaf field of the serve config: what values.schema.json and `pdserve serve`'s
    flags are checked against and made from.

    path: its dotted name, as in the YAML (`engine.model.source`).
    section: the frozen dataclass that declares it.
    kind: its annotation, resolved (`int | None`, `frozenset[str]`, ...).
    default: its default (a default factory's value).
    doc: its entry in the section's docstring.
    """

    path: str
    section: type
    kind: Any
    default: Any
    doc: str

    @property
    def name(self) -> str:
        return self.path.rpartition(".")[2]


def config_fields(cls: type = ServeConfig, prefix: str = "") -> list[ConfigField]:
    """Every leaf field of the config `cls` (the serve config unless told), in declaration
    order: dataclasses.fields from `cls` down, a dataclass-typed field being a section."""
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    leaves: list[ConfigField] = []
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            leaves += config_fields(kind, f"{prefix}{f.name}.")
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        leaves.append(ConfigField(prefix + f.name, cls, kind, default, docs.get(f.name, "")))
    return leaves


# "name: what it is" (or "a/b: ..." and "a, b: ..." for fields described together), at any
# indent (Google-style `Attributes:` too); more indented lines below it continue it.
_DOC_ENTRY = re.compile(r"^( *)([A-Za-z_]\w*(?:(?:/|, )[A-Za-z_]\w*)*): (.+)$")


def field_docs(cls: type) -> dict[str, str]:
    """Each field's entry in the docstring of the config dataclass `cls`, its lines joined."""
    names = {f.name for f in dataclasses.fields(cls)}
    docs: dict[str, str] = {}
    entry: list[str] = []
    indent = 0
    for line in inspect.cleandoc(cls.__doc__ or "").splitlines():
        m = _DOC_ENTRY.match(line)
        if m and set(re.split("/|, ", m[2])) <= names:
            entry, indent = re.split("/|, ", m[2]), len(m[1])
            docs.update(dict.fromkeys(entry, m[3].strip()))
        elif entry and line.strip() and len(line) - len(line.lstrip()) > indent:
            for name in entry:
                docs[name] += " " + line.strip()
        else:
            entry = []
    return docs


Config = TypeVar("Config")


def with_values(config: Config, values: dict[str, Any], name: Callable[[str], str] = str) -> Config:
    """`config` (a ServeConfig, or any config dataclass) with the fields named by dotted path
    replaced, e.g. {"server.port": 1, "engine.model.source": "dummy:tiny"}. Each section that
    changes is validated again; a bad value is a ValueError that names the fields to blame
    by `name(path)` (say, the flags that gave them)."""
    return _with_values(config, values, "", name)


def _with_values(config: Any, values: dict[str, Any], prefix: str, name: Callable[[str], str]) -> Any:
    fields = {f.name for f in dataclasses.fields(config)}
    leaves: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for path, value in values.items():
        head, dot, rest = path.partition(".")
        if head not in fields or bool(dot) != dataclasses.is_dataclass(getattr(config, head)):
            raise ValueError(f"{name(prefix + path)}: no such config field {prefix + path!r}")
        if dot:
            nested.setdefault(head, {})[rest] = value
        else:
            leaves[head] = value
    changes = {head: _with_values(getattr(config, head), sub, f"{prefix}{head}.", name)
               for head, sub in nested.items()}
    try:
        return dataclasses.replace(config, **changes, **leaves)
    except (TypeError, ValueError) as e:
        given = [prefix + path for path in values]
        blamed = [p for p in given if re.search(rf"\b{p.rpartition('.')[2]}\b", str(e))] or given
        raise ValueError(f"{', '.join(name(p) for p in blamed)}: {e}") from e
