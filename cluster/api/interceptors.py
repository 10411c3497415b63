"""The gRPC server's interceptors.

`MalformedRequestInterceptor`: a request that does not parse as its method's message is
INVALID_ARGUMENT. grpc deserializes a request before the servicer sees it, and answers a
corrupt one with UNKNOWN and a traceback in the log; this interceptor parses unary requests
itself (the handler gets raw bytes), so that a malformed one is the client's error, named as such.

`BearerTokenInterceptor`: the clients' token (`auth.bearer_matches`); health checks pass.
`AdminTokenInterceptor`: the admin API (the gRPC `Admin` service) has a token of its own,
checked by it alone: the clients' token opens no admin call, and the admin token no client call.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from pdserve.cluster.api.auth import TOKEN_MESSAGE, bearer_matches

HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"
ADMIN_METHOD_PREFIX = "/pdserve.v1.Admin/"
_ADMIN_OFF = ("the admin API is off: start the server with --admin-token-file FILE (server.admin_token_file), "
              "FILE holding a token of its own, and call it with that token")
_ADMIN_MESSAGE = "missing or wrong admin token (authorization: Bearer <admin token>, pdserve --admin-token-file)"
_NOT_ADMIN = "the clients' token opens no admin call: admin calls need the admin token (--admin-token-file)"


@dataclass(frozen=True, slots=True)
class _Malformed:
    error: str


def _tolerant(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        if deserialize is None:
            return data
        try:
            return deserialize(data)
        except Exception as e:  # noqa: BLE001 - DecodeError, or anything a parser raises on junk
            return _Malformed(f"{type(e).__name__}: {e}")
    return parse


async def _refuse(context: grpc.aio.ServicerContext, request: _Malformed) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request does not parse: {request.error}")


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """INVALID_ARGUMENT, not UNKNOWN, for a unary request that does not parse."""

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_streaming:
            return handler
        codec = {"request_deserializer": _tolerant(handler.request_deserializer),
                 "response_serializer": handler.response_serializer}
        if handler.unary_unary:
            behavior = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, _Malformed):
                    await _refuse(context, request)
                result = behavior(request, context)
                return await result if inspect.isawaitable(result) else result

            return grpc.unary_unary_rpc_method_handler(unary, **codec)
        streaming = handler.unary_stream

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Malformed):
                await _refuse(context, request)
            result = streaming(request, context)
            if inspect.isasyncgen(result):
                async for response in result:
                    yield response
            elif inspect.isawaitable(result):  # a handler that writes through context.write
                await result
            else:
                for response in result:
                    yield response

        return grpc.unary_stream_rpc_method_handler(stream, **codec)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for a call without `authorization: Bearer <token>` metadata."""

    def __init__(self, token: str | tuple[str, ...]) -> None:
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

    def __init__(self, admin_token: str | None, client_token: str | tuple[str, ...] | None) -> None:
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


def _presents(details: grpc.HandlerCallDetails, token: str | tuple[str, ...]) -> bool:
    """Whether the call's metadata carries `authorization: Bearer <token>`."""
    metadata: Sequence[tuple[str, Any]] = details.invocation_metadata or ()
    return any(k == "authorization" and bearer_matches(v, token) for k, v in metadata)


def _refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED,
              message: str = TOKEN_MESSAGE) -> grpc.RpcMethodHandler:
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
