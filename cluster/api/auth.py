"""Client authentication for the client APIs: TLS (optionally mutual) and bearer tokens.

TLS: the gRPC server credentials and the HTTP API's uvicorn options, from ServerConfig's
files. With a client CA (mutual TLS) both refuse a client without a certificate signed by
it in the TLS handshake, before any request is read.

Tokens: `bearer_matches` compares in constant time; the HTTP API checks it in an ASGI
middleware here, gRPC in the interceptors (`interceptors.py`). Both let the health checks
through (probes carry no token). The token itself is never logged or echoed.
"""

from __future__ import annotations

import hmac
import json
import ssl
from dataclasses import dataclass
from typing import Any

import grpc
from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.cluster.settings.config import ServerConfig
from pdserve.cluster.settings.secrets import ClientAuth

HEALTH_PATHS = ("/health",)
TOKEN_MESSAGE = "missing or wrong bearer token (Authorization: Bearer <token>)"


def grpc_server_credentials(auth: ClientAuth) -> grpc.ServerCredentials:
    """TLS credentials of the gRPC port (`auth.tls` must be true); with a client CA, a client
    must present a certificate that chains to it."""
    assert auth.tls_cert_chain is not None and auth.tls_private_key is not None
    return grpc.ssl_server_credentials([(auth.tls_private_key, auth.tls_cert_chain)],
                                       root_certificates=auth.tls_client_ca,
                                       require_client_auth=auth.mutual_tls)


@dataclass(frozen=True, slots=True)
class HttpTls:
    """The HTTP API's TLS files (uvicorn reads them itself): certificate (chain), key, and
    the CA client certificates must chain to ("" asks for none)."""

    cert_file: str
    key_file: str
    client_ca_file: str = ""

    @classmethod
    def of(cls, server: ServerConfig) -> HttpTls | None:
        """None when `server` has no TLS (plaintext)."""
        if not server.tls_cert:
            return None
        return cls(server.tls_cert, server.tls_key, server.tls_client_ca)

    def uvicorn_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"ssl_certfile": self.cert_file, "ssl_keyfile": self.key_file}
        if self.client_ca_file:
            options.update(ssl_ca_certs=self.client_ca_file, ssl_cert_reqs=ssl.CERT_REQUIRED)
        return options


def bearer_matches(header: str | bytes | None, token: str | tuple[str, ...]) -> bool:
    """Whether `header` is `Bearer <token>` (one of several: the tenants' keys, every one compared)."""
    if isinstance(header, bytes):
        header = header.decode(errors="replace")
    if not header or not header.startswith("Bearer "):
        return False
    presented = header[len("Bearer "):].strip().encode()
    tokens = (token,) if isinstance(token, str) else token
    return any([hmac.compare_digest(presented, t.encode()) for t in tokens])


class BearerTokenMiddleware:
    """ASGI: 401 in OpenAI's error shape (the openai clients raise AuthenticationError) for a
    request without `Authorization: Bearer <token>`; /health passes."""

    def __init__(self, app: ASGIApp, token: str | tuple[str, ...]) -> None:
        self.app = app
        self._token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in HEALTH_PATHS:
            await self.app(scope, receive, send)
            return
        header = dict(scope.get("headers") or ()).get(b"authorization")
        if bearer_matches(header, self._token):
            await self.app(scope, receive, send)
            return
        body = json.dumps({"error": {"message": TOKEN_MESSAGE, "type": "invalid_request_error", "param": None,
                                     "code": "invalid_api_key"}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
