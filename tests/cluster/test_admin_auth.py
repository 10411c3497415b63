"""The admin API's token, on a gRPC server of the real interceptors and services in this
process (no Ray): admin calls need the admin token (none or a wrong one: UNAUTHENTICATED; the
clients' token: PERMISSION_DENIED), the admin token opens no client call, and with no admin
token configured every admin call is refused, saying how to turn the API on."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest

from pdserve.cluster.api.admin_service import AdminService
from pdserve.cluster.api.interceptors import AdminTokenInterceptor, BearerTokenInterceptor
from pdserve.cluster.clients.admin_client import AdminClient
from pdserve.cluster.clients.credentials import ClientCredentials
from pdserve.cluster.settings.config import ServerConfig
from pdserve.cluster.settings.secrets import client_auth
from pdserve.proto.v1 import admin_pb2_grpc, generation_pb2, generation_pb2_grpc

CLIENT_TOKEN = "client-token-0123456789"
ADMIN_TOKEN = "admin-token-0123456789"


class _NoWorkers:
    """The part of `Elastic` ListWorkers reads."""

    def workers(self) -> list:
        return []


class _Info(generation_pb2_grpc.GenerationServicer):
    async def GetServerInfo(self, request, context):  # noqa: N802
        return generation_pb2.ServerInfo(version="test")


def _serve(admin_token: str | None) -> Iterator[str]:
    """A server with the client token and `admin_token` on a loop thread of its own; yields its target."""
    import threading

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server(interceptors=[AdminTokenInterceptor(admin_token, CLIENT_TOKEN),
                                               BearerTokenInterceptor(CLIENT_TOKEN)])
        admin_pb2_grpc.add_AdminServicer_to_server(AdminService(_NoWorkers()), server)  # type: ignore[arg-type]
        generation_pb2_grpc.add_GenerationServicer_to_server(_Info(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    yield f"127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)


@pytest.fixture(scope="module")
def target() -> Iterator[str]:
    yield from _serve(ADMIN_TOKEN)


@pytest.fixture(scope="module")
def target_without_admin() -> Iterator[str]:
    yield from _serve(None)


def _refusal(target: str, token: str | None) -> grpc.RpcError:
    with AdminClient(target, ClientCredentials(api_key=token)) as admin, pytest.raises(grpc.RpcError) as refused:
        admin.workers()
    return refused.value


@pytest.mark.parametrize("token", [None, "wrong-token-0123456789"])
def test_an_admin_call_without_the_admin_token_is_unauthenticated(target, token):
    refused = _refusal(target, token)
    assert refused.code() == grpc.StatusCode.UNAUTHENTICATED and "admin token" in refused.details()


def test_the_clients_token_is_no_admin_token(target):
    refused = _refusal(target, CLIENT_TOKEN)
    assert refused.code() == grpc.StatusCode.PERMISSION_DENIED
    assert CLIENT_TOKEN not in refused.details() and ADMIN_TOKEN not in refused.details()


def test_the_admin_token_opens_admin_calls_and_no_client_call(target):
    with AdminClient(target, ClientCredentials(api_key=ADMIN_TOKEN)) as admin:
        assert admin.workers() == []
    with grpc.insecure_channel(target) as channel, pytest.raises(grpc.RpcError) as refused:
        generation_pb2_grpc.GenerationStub(channel).GetServerInfo(
            generation_pb2.GetServerInfoRequest(), timeout=10, metadata=(("authorization", f"Bearer {ADMIN_TOKEN}"),))
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_without_an_admin_token_the_admin_api_is_off_and_says_how_to_turn_it_on(target_without_admin):
    for token in (None, CLIENT_TOKEN, ADMIN_TOKEN):
        refused = _refusal(target_without_admin, token)
        assert refused.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "admin API is off" in refused.details() and "--admin-token-file" in refused.details()


def test_the_admin_token_must_differ_from_the_clients(tmp_path):
    same = tmp_path / "token"
    same.write_text(CLIENT_TOKEN)
    with pytest.raises(ValueError, match="must differ"):
        client_auth(ServerConfig(api_key_file=str(same), admin_token_file=str(same)))
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="admin token file"):
        client_auth(ServerConfig(admin_token_file=str(empty)))
