"""A request that does not parse as its method's message is INVALID_ARGUMENT.

grpc deserializes a request before the servicer sees it, and answers a corrupt one with
UNKNOWN and a traceback in the log. This interceptor parses unary requests itself (the
handler gets raw bytes), so that a malformed one is the client's error, named as such.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc


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
