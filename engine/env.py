"""Every environment variable pdserve reads, read here and nowhere else.

In the lowest layer that needs one (the engine's weight cache), so that every layer above
(cluster: the cluster secret, the API token) reads through the same function. None of them
overrides a config file's field: each is what a field left unset falls back to, or a secret
that must never sit in a file. Nothing here writes to `os.environ`.
"""

from __future__ import annotations

import os

CACHE_DIR = "PDSERVE_CACHE_DIR"
CLUSTER_SECRET = "PDSERVE_CLUSTER_SECRET"
API_KEY = "PDSERVE_API_KEY"

VARIABLES: dict[str, str] = {
    CACHE_DIR: "where converted weights are cached (ModelConfig.cache_dir's default; ~/.cache/pdserve unset)",
    CLUSTER_SECRET: "the secret workers authenticate KV connections with (>= 16 bytes; a local cluster makes one)",
    API_KEY: "the bearer token clients must send, when server.api_key_file names no file",
}


def read(name: str) -> str | None:
    """The value of pdserve's environment variable `name` (one of VARIABLES); None if unset."""
    if name not in VARIABLES:
        raise KeyError(f"{name} is not one of pdserve's environment variables {sorted(VARIABLES)}")
    return os.environ.get(name)
