"""What the serve config's files and variables hold, read and checked: the cluster secret the
workers authenticate each other with, the clients' TLS material and tokens (`client_auth`),
the chat template. Every missing, empty or malformed one is a ValueError naming its field."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.cluster.settings.config import API_KEY_ENV, SECRET_ENV, ServerConfig
from pdserve.engine import env


def cluster_secret() -> bytes:
    """The secret workers authenticate each other with: $PDSERVE_CLUSTER_SECRET, or a fresh random one."""
    value = env.read(SECRET_ENV)
    if value:
        if len(value.encode()) < 16:
            raise ValueError(f"${SECRET_ENV} must be at least 16 bytes")
        return value.encode()
    return secrets.token_hex(32).encode()


@dataclass(frozen=True, slots=True)
class ClientAuth:
    """What the frontends ask of clients (see ServerConfig): TLS key material, the CA client
    certificates must chain to (mutual TLS), and the token."""

    tls_cert_chain: bytes | None = field(default=None, repr=False)
    tls_private_key: bytes | None = field(default=None, repr=False)
    api_key: str | None = field(default=None, repr=False)
    tls_client_ca: bytes | None = field(default=None, repr=False)
    admin_token: str | None = field(default=None, repr=False)  # None: the admin API is off

    @property
    def tls(self) -> bool:
        return self.tls_cert_chain is not None

    @property
    def mutual_tls(self) -> bool:
        return self.tls_client_ca is not None


def read_chat_template(server: ServerConfig) -> str | None:
    """The chat template file `server` names (None: the model's own); ValueError naming the flag."""
    if not server.chat_template:
        return None
    try:
        text = Path(server.chat_template).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the chat template (server.chat_template) {server.chat_template!r}: {e}") from e
    if not text.strip():
        raise ValueError(f"the chat template (server.chat_template) {server.chat_template!r} is empty")
    return text


def client_auth(server: ServerConfig) -> ClientAuth:
    """Read the files and $PDSERVE_API_KEY that `server` names; a missing or empty one is a ValueError."""

    def read(path: str, what: str) -> bytes:
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            raise ValueError(f"cannot read the {what} {path!r}: {e.strerror}") from e
        if not data.strip():
            raise ValueError(f"the {what} {path!r} is empty")
        return data

    cert = read(server.tls_cert, "TLS certificate (server.tls_cert)") if server.tls_cert else None
    key = read(server.tls_key, "TLS key (server.tls_key)") if server.tls_key else None
    client_ca = None
    if server.tls_client_ca:
        client_ca = read(server.tls_client_ca, "client CA file (server.tls_client_ca)")
        if b"-----BEGIN CERTIFICATE-----" not in client_ca:
            raise ValueError(f"the client CA file (server.tls_client_ca) {server.tls_client_ca!r} holds no "
                             "PEM certificate")
    if server.api_key_file:
        token: str | None = read(server.api_key_file, "API key file (server.api_key_file)").decode().strip()
    else:
        token = env.read(API_KEY_ENV) or None
    admin = None
    if server.admin_token_file:
        admin = read(server.admin_token_file, "admin token file (server.admin_token_file)").decode().strip()
        if admin == token:
            raise ValueError("the admin token (server.admin_token_file) must differ from the clients' token "
                             "(server.api_key_file or $PDSERVE_API_KEY): a client could run the admin API")
    return ClientAuth(cert, key, token, client_ca, admin)
