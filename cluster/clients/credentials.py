"""What pdserve's own clients (`pdserve generate`, `info`, `bench`, `Client`) present to a
server: the CA they trust (TLS), their own certificate and key (mutual TLS), the bearer token.

The server's side is `settings.secrets.ClientAuth`; this is the other end of it, one object for the
gRPC and the HTTP clients alike.
"""

from __future__ import annotations

import argparse
import ssl
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from pdserve.cluster.settings.config import ServerConfig
from pdserve.cluster.settings.secrets import client_auth


@dataclass(frozen=True, slots=True)
class ClientCredentials:
    """ca_file: PEM of the CA (or self-signed certificate) the server's certificate must chain
        to; set, the client speaks TLS. cert_file, key_file: the client's certificate (chain)
        and key, for a server that asks for one (mutual TLS; the client speaks TLS, trusting
        `ca_file` or the system's CAs). api_key: sent as `authorization: Bearer <api_key>`."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("a client certificate needs its key and a key its certificate "
                             "(--tls-client-cert and --tls-client-key together)")

    @property
    def tls(self) -> bool:
        return self.ca_file is not None or self.cert_file is not None

    def grpc_credentials(self) -> grpc.ChannelCredentials | None:
        """The channel's TLS credentials, None for plaintext. Raises ValueError for a file it cannot read."""
        if not self.tls:
            return None
        ca = _read(self.ca_file, "CA file (--tls-ca)") if self.ca_file else None
        if self.cert_file is None:
            return grpc.ssl_channel_credentials(ca)
        return grpc.ssl_channel_credentials(ca, _read(self.key_file, "client key (--tls-client-key)"),
                                            _read(self.cert_file, "client certificate (--tls-client-cert)"))

    def grpc_channel(self, target: str) -> grpc.Channel:
        """A channel to `target`: TLS when `tls`, else plaintext."""
        tls = self.grpc_credentials()
        return grpc.insecure_channel(target) if tls is None else grpc.secure_channel(target, tls)

    def grpc_aio_channel(self, target: str) -> grpc.aio.Channel:
        """`grpc_channel` for asyncio."""
        tls = self.grpc_credentials()
        return grpc.aio.insecure_channel(target) if tls is None else grpc.aio.secure_channel(target, tls)

    def ssl_context(self) -> ssl.SSLContext | None:
        """The HTTPS context, None for plain HTTP (an https:// URL then trusts the system's CAs)."""
        if not self.tls:
            return None
        try:
            context = ssl.create_default_context(cafile=self.ca_file)
            if self.cert_file is not None:
                context.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"cannot use the TLS files {self._files()}: {e}") from e
        return context

    def grpc_metadata(self) -> tuple[tuple[str, str], ...] | None:
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else None

    def http_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _files(self) -> str:
        return ", ".join(repr(f) for f in (self.ca_file, self.cert_file, self.key_file) if f)


def add_credential_args(p: argparse.ArgumentParser) -> None:
    """The flags `from_args` reads, for every client command."""
    _add_tls_args(p)
    p.add_argument("--api-key-file", default=None, help="file with the server's bearer token "
                                                        "(default: $PDSERVE_API_KEY, if set)")


def add_admin_credential_args(p: argparse.ArgumentParser) -> None:
    """The flags `admin_from_args` reads, for the admin commands (`pdserve workers | drain | scale`)."""
    _add_tls_args(p)
    p.add_argument("--admin-token-file", default=None,
                   help="file with the server's admin token (its --admin-token-file), not the clients' token")


def _add_tls_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-ca", default=None, help="PEM file of the CA (or self-signed certificate) the "
                                                  "server's certificate must chain to: connect over TLS")
    p.add_argument("--tls-client-cert", default=None,
                   help="PEM certificate (chain) to present to a server that asks for one (mutual TLS)")
    p.add_argument("--tls-client-key", default=None, help="PEM private key of --tls-client-cert")


def from_args(args: argparse.Namespace) -> ClientCredentials:
    """The credentials the flags of `add_credential_args` name; the token from --api-key-file or
    $PDSERVE_API_KEY, read where the server reads its own."""
    token = client_auth(ServerConfig(api_key_file=args.api_key_file or "")).api_key
    return ClientCredentials(args.tls_ca, args.tls_client_cert, args.tls_client_key, token)


def admin_from_args(args: argparse.Namespace) -> ClientCredentials:
    """The credentials of an admin call: the TLS files as `from_args`, the admin token (read
    where the server reads its own) as the bearer token."""
    token = client_auth(ServerConfig(admin_token_file=args.admin_token_file or "")).admin_token
    return ClientCredentials(args.tls_ca, args.tls_client_cert, args.tls_client_key, token)


def _read(path: str | None, what: str) -> bytes:
    assert path is not None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read the {what} {path!r}: {e.strerror}") from e
