"""Tenants: who a request is for, from the API key it presents, and each tenant's weight in
the fair shares: the frontend's admission (`cluster/api/admission.py`), its seat line
(`cluster/serving/seats.py`) and the engines' schedulers (`engine/tenant_share.py`, the tenant
carried in the request's `SamplingParams`), which hold the share across frontends.

The operator's tenants file (`ServerConfig.tenants_file`, `--tenants-file`; YAML, a secret
like the API key file, never logged):

    tenants:
      - name: chat
        weight: 3          # > 0; 1 by default
        api_keys: [key-of-the-chat-product]
      - name: batch
        api_keys: [key-a, key-b]

Every key in it is a client token the APIs accept (beside `api_key_file`'s). A request whose
key is in no tenant's list (or without a file) is the default tenant's, weight 1.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from pathlib import Path

import yaml

DEFAULT_TENANT_NAME = "default"


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str = DEFAULT_TENANT_NAME
    weight: float = 1.0


DEFAULT_TENANT = Tenant()


@dataclass(frozen=True, slots=True)
class Tenants:
    """The tenants and their keys; `of` names a request's tenant from its Authorization header."""

    by_key: tuple[tuple[str, Tenant], ...] = field(default=(), repr=False)

    @classmethod
    def load(cls, path: str) -> Tenants:
        """The tenants file at `path` ("": none); ValueError naming what is wrong."""
        if not path:
            return cls()
        try:
            data = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"cannot read the tenants file (server.tenants_file) {path!r}: {e}") from e
        return cls.parse(data)

    @classmethod
    def parse(cls, data: object) -> Tenants:
        entries = data.get("tenants") if isinstance(data, dict) else None
        if not isinstance(entries, list) or not entries:
            raise ValueError("the tenants file needs a non-empty list `tenants`")
        by_key: dict[str, Tenant] = {}
        names: set[str] = set()
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict):
                raise ValueError(f"tenants[{i}] must be a mapping with name, weight and api_keys")
            name, weight, keys = entry.get("name"), entry.get("weight", 1), entry.get("api_keys")
            if not isinstance(name, str) or not name or name in names:
                raise ValueError(f"tenants[{i}].name must be a non-empty name of its own, got {name!r}")
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
                raise ValueError(f"tenants[{i}].weight must be a number > 0, got {weight!r}")
            if not isinstance(keys, list) or not keys or not all(isinstance(k, str) and k.strip() for k in keys):
                raise ValueError(f"tenants[{i}].api_keys must be a non-empty list of keys")
            names.add(name)
            for key in keys:
                if key.strip() in by_key:
                    raise ValueError(f"tenants[{i}].api_keys: a key is given twice (tenants' keys are theirs alone)")
                by_key[key.strip()] = Tenant(name, float(weight))
        return cls(tuple(by_key.items()))

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(key for key, _ in self.by_key)

    def of(self, authorization: str | bytes | None) -> Tenant:
        """The tenant whose key `Authorization: Bearer <key>` presents (the default tenant for
        none or an unknown one). Every key is compared, in constant time each."""
        if isinstance(authorization, bytes):
            authorization = authorization.decode(errors="replace")
        if not self.by_key or not authorization or not authorization.startswith("Bearer "):
            return DEFAULT_TENANT
        presented = authorization[len("Bearer "):].strip().encode()
        matches = [tenant for key, tenant in self.by_key if hmac.compare_digest(presented, key.encode())]
        return matches[0] if matches else DEFAULT_TENANT
