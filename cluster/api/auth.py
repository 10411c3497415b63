"""Client authentication for the client APIs: TLS (optionally mutual) and bearer tokens.

TLS: the gRPC server credentials and the HTTP API's uvicorn options, from ServerConfig's
files. With a client CA (mutual TLS) both refuse a client without a certificate signed by
it in the TLS handshake, before any request is read.

Tokens: a gRPC server interceptor and an ASGI middleware. Both compare in constant time
and let the health checks through (probes carry no token). The token itself is never
logged or echoed.

The admin API (the gRPC `Admin` service) has a token of its own, checked by
`AdminTokenInterceptor` alone: the clients' token opens no admin call, and the admin token
no client call.
"""

from __future__ import annotations

import hmac
import json
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.cluster.settings.config import ClientAuth, ServerConfig

HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"
ADMIN_METHOD_PREFIX = "/pdserve.v1.Admin/"
HEALTH_PATHS = ("/health",)
_MESSAGE = "missing or wrong bearer token (Authorization: Bearer <token>)"
_ADMIN_OFF = ("the admin API is off: start the server with --admin-token-file FILE (server.admin_token_file), "
              "FILE holding a token of its own, and call it with that token")
_ADMIN_MESSAGE = "missing or wrong admin token (authorization: Bearer <admin token>, pdserve --admin-token-file)"
_NOT_ADMIN = "the clients' token opens no admin call: admin calls need the admin token (--admin-token-file)"


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


def _matches(header: str | bytes | None, token: str) -> bool:
    if isinstance(header, bytes):
        header = header.decode(errors="replace")
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer "):].strip().encode(), token.encode())


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for a call without `authorization: Bearer <token>` metadata."""

    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith((HEALTH_METHOD_PREFIX, ADMIN_METHOD_PREFIX)):
            return handler  # the admin API: AdminTokenInterceptor's
        if _presents(details, self._token):
            return handler
        return _refusing(handler)


class AdminTokenInterceptor(grpc.aio.ServerInterceptor):
    """The admin service's calls need `authorization: Bearer <admin token>`: without a token
    or with a wrong one UNAUTHENTICATED, with the clients' token PERMISSION_DENIED (a client,
    not an admin); with no admin token configured (None) every admin call is refused,
    saying how to turn the API on. Other calls pass untouched."""

    def __init__(self, admin_token: str | None, client_token: str | None) -> None:
        self._admin_token = admin_token
        self._client_token = client_token

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(ADMIN_METHOD_PREFIX):
            return handler
        if self._admin_token is None:
            return _refusing(handler, grpc.StatusCode.PERMISSION_DENIED, _ADMIN_OFF)
        if _presents(details, self._admin_token):
            return handler
        if self._client_token is not None and _presents(details, self._client_token):
            return _refusing(handler, grpc.StatusCode.PERMISSION_DENIED, _NOT_ADMIN)
        return _refusing(handler, grpc.StatusCode.UNAUTHENTICATED, _ADMIN_MESSAGE)


def _presents(details: grpc.HandlerCallDetails, token: str) -> bool:
    """Whether the call's metadata carries `authorization: Bearer <token>`."""
    metadata: Sequence[tuple[str, Any]] = details.invocation_metadata or ()
    return any(k == "authorization" and _matches(v, token) for k, v in metadata)


def _refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED,
              message: str = _MESSAGE) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that answers `code` with `message`."""

    async def unary(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    async def stream(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)
        yield  # an async generator, as a streaming handler is

    codec = {"request_deserializer": handler.request_deserializer,
             "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, **codec)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream, **codec)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, **codec)
    return grpc.stream_stream_rpc_method_handler(stream, **codec)


class BearerTokenMiddleware:
    """ASGI: 401 in OpenAI's error shape (the openai clients raise AuthenticationError) for a
    request without `Authorization: Bearer <token>`; /health passes."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self._token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in HEALTH_PATHS:
            await self.app(scope, receive, send)
            return
        header = dict(scope.get("headers") or ()).get(b"authorization")
        if _matches(header, self._token):
            await self.app(scope, receive, send)
            return
        body = json.dumps({"error": {"message": _MESSAGE, "type": "invalid_request_error", "param": None,
                                     "code": "invalid_api_key"}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
