"""The OpenAI-compatible HTTP API (Starlette on uvicorn), beside gRPC in the same event loop.

`POST /v1/completions`, `POST /v1/chat/completions` (server-sent events with `stream`),
`GET /v1/models`, `GET /health`. Each call's choices run through the shared `Frontend`
(the coordinator, router and pools the gRPC service uses). Errors come in OpenAI's shape,
{"error": {"message", "type", "param", "code"}}: 400 bad input (malformed bodies too),
404 unknown model or route, 415 a body that is not JSON, 429 full, 503 no worker (or none
that the KV transport may pair: code failed_precondition), 504 deadline. A client that goes
away cancels its requests, which frees their blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import uvicorn
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Send

from pdserve.cluster.api import openai_models as m
from pdserve.cluster.api.auth import BearerTokenMiddleware, HttpTls
from pdserve.cluster.api.frontend import Frontend, RequestFailed, Status
from pdserve.cluster.api.openai_protocol import (
    ChatRenderer,
    Choice,
    CompletionRenderer,
    chat_choices,
    completion_choices,
)
from pdserve.cluster.settings.tenants import DEFAULT_TENANT, Tenant
from pdserve.engine.outputs import TextDelta
from pdserve.engine.text.request_processor import RequestProcessor
from pdserve.engine.text.tool_parsers import GENERIC_FORMAT

logger = logging.getLogger(__name__)

_HTTP = {Status.INVALID_ARGUMENT: (400, "invalid_request_error", None),
         Status.NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
         Status.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
         Status.UNAVAILABLE: (503, "server_error", "service_unavailable"),
         Status.FAILED_PRECONDITION: (503, "server_error", "failed_precondition"),
         Status.DEADLINE_EXCEEDED: (504, "server_error", "timeout"),
         Status.CANCELLED: (499, "server_error", "cancelled"),
         Status.INTERNAL: (500, "server_error", "internal_error")}
Body = TypeVar("Body", bound=BaseModel)
CallBody = TypeVar("CallBody", m.CompletionRequest, m.ChatCompletionRequest)
Renderer = CompletionRenderer | ChatRenderer


class ApiError(Exception):
    def __init__(self, status: Status, message: str, param: str | None = None, http_status: int | None = None,
                 code: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.retry_after_s = status, param, retry_after_s
        default_http, self.type, default_code = _HTTP[status]
        self.http_status, self.code = http_status or default_http, code or default_code

    def body(self) -> m.ErrorResponse:
        return m.ErrorResponse(error=m.ErrorInfo(message=str(self), type=self.type, param=self.param, code=self.code))

    def response(self) -> Response:
        # 429: Retry-After (whole seconds, at least 1) tells a client when a retry may find room.
        headers = {} if self.retry_after_s is None else {"Retry-After": str(max(1, round(self.retry_after_s)))}
        return Response(self.body().model_dump_json(), self.http_status, headers, media_type="application/json")


class _ClientGone(Exception):
    pass


class OpenAIApi:
    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
        self.processor = frontend.processor
        self.created = int(time.time())

    def app(self) -> Starlette:
        routes = [Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/health", self.health, methods=["GET"])]
        return Starlette(routes=routes, exception_handlers={HTTPException: _http_error, Exception: _internal_error})

    async def completions(self, request: Request) -> Response:
        return await self._call(request, m.CompletionRequest, completion_choices, CompletionRenderer, "cmpl")

    async def chat_completions(self, request: Request) -> Response:
        return await self._call(request, m.ChatCompletionRequest, chat_choices, ChatRenderer, "chatcmpl")

    async def _call(self, request: Request, model: type[CallBody],
                    make_choices: Callable[[CallBody, RequestProcessor], list[Choice]],
                    make_renderer: Callable[[RequestProcessor, str, int, str], Renderer], prefix: str) -> Response:
        try:
            body = await self._body(request, model)
            tenant = self.frontend.tenants.of(request.headers.get("authorization"))
            choices = self._choices(body, lambda: make_choices(body, self.processor), tenant)
            renderer = make_renderer(self.processor, f"{prefix}-{uuid.uuid4().hex}", int(time.time()),
                                     self.processor.model_name)
            return await self._respond(request, body, choices, renderer, tenant)
        except ApiError as e:
            return e.response()
        except _ClientGone:
            return Response(status_code=499)  # nobody reads it

    async def models(self, request: Request) -> Response:
        p = self.processor
        card = m.ModelCard(id=p.model_name, created=self.created, max_model_len=p.max_model_len)
        return _json(m.ModelList(data=[card]))

    async def health(self, request: Request) -> Response:
        # A pool whose workers all drain takes no request either.
        down = self.frontend.worker_set.unserved_roles()
        if down:
            return ApiError(Status.UNAVAILABLE, f"no healthy {' or '.join(down)} worker").response()
        return Response('{"status":"ok"}', media_type="application/json")

    # One call -------------------------------------------------------------

    async def _body(self, request: Request, model: type[Body]) -> Body:
        content_type = request.headers.get("content-type", "")
        if content_type.split(";")[0].strip().lower() != "application/json":
            self.frontend.count(Status.INVALID_ARGUMENT)
            raise ApiError(Status.INVALID_ARGUMENT, f"the body must be JSON (Content-Type: application/json), "
                                                    f"got {content_type or 'no Content-Type'!r}", http_status=415,
                           code="unsupported_media_type")
        try:
            return model.model_validate_json(await request.body())
        except ValidationError as e:
            self.frontend.count(Status.INVALID_ARGUMENT)
            err = e.errors(include_url=False)[0]
            param = ".".join(str(x) for x in err["loc"]) or None
            where = f"{param}: " if param else ""
            raise ApiError(Status.INVALID_ARGUMENT, f"{where}{err['msg']}", param) from e

    def _choices(self, body: m.CompletionRequest | m.ChatCompletionRequest,
                 make: Callable[[], list[Choice]], tenant: Tenant = DEFAULT_TENANT) -> list[Choice]:
        name = self.processor.model_name
        try:
            if body.model is not None and body.model != name:
                raise ApiError(Status.NOT_FOUND, f"the model {body.model!r} does not exist; this server serves "
                                                 f"{name!r}", "model")
            field = body.unsupported()
            if field is not None:
                raise ApiError(Status.INVALID_ARGUMENT, f"{field} is not supported by this server", field)
            try:
                choices = make()
            except ValueError as e:
                raise ApiError(Status.INVALID_ARGUMENT, str(e), _param(str(e), body)) from e
        except ApiError as e:
            self.frontend.count(e.status)
            raise
        try:
            self.frontend.check_capacity(len(choices), choices[0].request.params.priority, tenant)
        except RequestFailed as e:
            raise ApiError(e.status, str(e), retry_after_s=e.retry_after_s) from e
        return choices

    async def _respond(self, request: Request, body: m.CompletionRequest | m.ChatCompletionRequest,
                       choices: list[Choice], renderer: Renderer, tenant: Tenant = DEFAULT_TENANT) -> Response:
        run = _Run(self.frontend, choices, tenant)
        # Said to the client: its tools went in pdserve's generic format (the template renders none).
        headers = {"x-pdserve-tool-format": "generic"} if choices[0].request.tool_format is GENERIC_FORMAT else {}
        try:
            if not body.stream:
                await _unless_disconnected(request, run.wait_all())
                return _json(renderer.response(choices), headers)
            first = await _unless_disconnected(request, run.next())  # errors before the first token keep status
        except RequestFailed as e:
            run.cancel()
            return ApiError(e.status, str(e), retry_after_s=e.retry_after_s).response()
        except BaseException:  # _ClientGone, or the server stopping
            run.cancel()
            raise
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return _EventStream(_events(run, first, renderer, include_usage), media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache", **headers})


class _Run:
    """The choices of one call, run at once through the frontend; their deltas in arrival order."""

    def __init__(self, frontend: Frontend, choices: list[Choice], tenant: Tenant = DEFAULT_TENANT) -> None:
        self.choices = choices
        self.num_running = len(choices)
        self.queue: asyncio.Queue[tuple[Choice, TextDelta] | RequestFailed] = asyncio.Queue()
        self.tasks = {id(c): asyncio.create_task(self._one(frontend, c, tenant)) for c in choices}
        self._finished: set[int] = set()  # choices whose last delta is out

    async def _one(self, frontend: Frontend, choice: Choice, tenant: Tenant) -> None:
        try:
            async for delta in frontend.generate(choice.request, tenant=tenant):
                self.queue.put_nowait((choice, delta))
        except RequestFailed as e:
            self.queue.put_nowait(e)

    async def next(self) -> tuple[Choice, TextDelta] | None:
        """The next delta of any choice (added to its output), None once all have finished."""
        if not self.num_running:
            return None
        item = await self.queue.get()
        if isinstance(item, RequestFailed):
            raise item
        choice, delta = item
        choice.output.add(delta)
        if delta.finished:
            self.num_running -= 1
            self._finished.add(id(choice))
        return item

    async def wait_all(self) -> None:
        while await self.next() is not None:
            pass

    def cancel(self) -> None:
        """Cancel the choices still running. A finished one's task is left to end by itself: it
        is in its request's cleanup (and counts it OK) after its last delta."""
        for key, task in self.tasks.items():
            if key not in self._finished:
                task.cancel()


async def _events(run: _Run, first: tuple[Choice, TextDelta] | None, renderer: Renderer,
                  include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: one chunk per delta, usage (if asked), `data: [DONE]`."""
    item = first
    try:
        while item is not None:
            for chunk in renderer.chunks(*item):
                yield f"data: {chunk.model_dump_json()}\n\n"
            item = await run.next()
        if include_usage:
            yield f"data: {renderer.usage_chunk(run.choices).model_dump_json()}\n\n"
    except RequestFailed as e:  # after the first token the status line is gone: an error event, as OpenAI does
        yield f"data: {ApiError(e.status, str(e)).body().model_dump_json()}\n\n"
    finally:
        run.cancel()
    yield "data: [DONE]\n\n"


class _EventStream(StreamingResponse):
    """Closes its events when the stream ends in any way, so that a client gone mid-send
    cancels its requests at once (not when the generator is collected)."""

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]


T = TypeVar("T")


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or _ClientGone (with `work` cancelled) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # we were cancelled (the server stops)
        task.cancel()
        raise
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        raise _ClientGone()
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _param(message: str, body: BaseModel) -> str | None:
    """The request field an error message starts with ("temperature must be >= 0, ..." -> "temperature")."""
    word = re.match(r"[\w.\[\]]+", message)
    if word is None:
        return None
    name = word.group(0).split("[")[0].split(".")[0]
    return word.group(0) if name in type(body).model_fields else None


def _json(body: BaseModel, headers: dict[str, str] | None = None) -> Response:
    return Response(body.model_dump_json(), headers=headers, media_type="application/json")


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    status = Status.NOT_FOUND if exc.status_code == 404 else Status.INVALID_ARGUMENT
    return ApiError(status, f"{request.method} {request.url.path}: {exc.detail}", http_status=exc.status_code,
                    code="not_found" if exc.status_code == 404 else None).response()


async def _internal_error(request: Request, exc: Exception) -> Response:
    logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return ApiError(Status.INTERNAL, "internal server error").response()


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # pdserve's own loop handles SIGINT and SIGTERM
        yield


class HttpServer:
    """uvicorn serving the API on the running event loop; `start` binds, `stop` drains."""

    def __init__(self, frontend: Frontend, tls: HttpTls | None = None, api_key: str | tuple[str, ...] | None = None,
                 shutdown_grace_s: float = 2.0) -> None:
        self.api = OpenAIApi(frontend)
        self._shutdown_grace_s = shutdown_grace_s  # ServerConfig.shutdown_grace_s
        self._tls = tls  # HTTPS only (with a client CA: mutual TLS)
        self._api_key = api_key  # asked of every call but /health (cluster/api/auth.py)
        self._server: _Uvicorn | None = None
        self._task: asyncio.Task | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> None:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            sock.close()
            raise ValueError(f"cannot bind the HTTP API to {host}:{port}: {e}") from e
        self.port = sock.getsockname()[1]
        # log_config=None: uvicorn's loggers propagate to pdserve's logging, which it leaves as it is.
        app = self.api.app()
        if self._api_key:
            app = BearerTokenMiddleware(app, self._api_key)
        tls = self._tls.uvicorn_options() if self._tls else {}
        config = uvicorn.Config(app, lifespan="off", log_config=None, log_level="warning",
                                access_log=False, timeout_graceful_shutdown=self._shutdown_grace_s, ws="none",
                                **tls)
        self._server = _Uvicorn(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise ValueError(f"the HTTP API on {host}:{port} did not start")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        await self._task
