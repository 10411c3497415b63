"""TLS and a bearer token on both client APIs, through the real grpc, httpx and openai clients.

A server with a self-signed certificate and a token (from a file) serves the right
client; a client without the token, with a wrong one, or in plaintext is refused; the
health checks answer without a token; the token is never logged.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import ssl
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.cluster.client import Client
from pdserve.engine.sampling import SamplingParams
from pdserve.proto.v1 import generation_pb2 as pb
from pdserve.proto.v1 import generation_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

TOKEN = "s3cret-test-token-0123456789"
GREEDY = SamplingParams(temperature=0.0, max_tokens=3)


def _self_signed(folder: Path) -> tuple[Path, Path]:
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@pytest.fixture(scope="module")
def secured(start, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    cert, key = _self_signed(folder)
    token_file = folder / "token"
    token_file.write_text(TOKEN + "\n")
    handler, logs = _Records(), logging.getLogger("pdserve")
    level = logs.level
    logs.addHandler(handler)
    logs.setLevel(logging.DEBUG)
    try:
        srv = start(pools={"mode": "colocated"},
                    server={"tls_cert": str(cert), "tls_key": str(key), "api_key_file": str(token_file)})
    finally:
        logs.removeHandler(handler)
        logs.setLevel(level)
    return srv, cert.read_bytes(), handler


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    return err.value.code()


def test_grpc_over_tls_with_the_token_serves(secured):
    srv, ca, _ = secured
    with Client(srv.target, ca, TOKEN) as client:
        out = [t for r in client.generate("Hello", GREEDY, timeout_s=120) for t in r.token_ids]
        assert len(out) == 3
        assert client.list_models().models


@pytest.mark.parametrize("api_key", [None, "wrong-token", TOKEN + "x"])
def test_grpc_without_the_right_token_is_unauthenticated(secured, api_key):
    srv, ca, _ = secured
    with Client(srv.target, ca, api_key) as client:
        assert _code(client.generate("Hello", GREEDY, timeout_s=30)) == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            client.server_info()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_grpc_plaintext_is_refused_and_health_needs_no_token(secured):
    srv, ca, _ = secured
    with Client(srv.target, None, TOKEN) as plain:
        assert _code(plain.generate("Hello", GREEDY, timeout_s=10)) == grpc.StatusCode.UNAVAILABLE
    with grpc.secure_channel(srv.target, grpc.ssl_channel_credentials(ca)) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        # A raw stub with metadata of its own, as any gRPC client would send it.
        stub = pb_grpc.GenerationStub(channel)
        info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10,
                                  metadata=(("authorization", f"Bearer {TOKEN}"),))
        assert info.workers


def test_openai_client_over_https_with_the_token(secured):
    srv = secured[0]
    url = srv.http_url.replace("http://", "https://") + "/v1"
    with httpx.Client(verify=ssl.create_default_context(cafile=srv.config.server.tls_cert)) as http:
        good = openai.OpenAI(base_url=url, api_key=TOKEN, http_client=http, max_retries=0)
        model = good.models.list().data[0].id
        out = good.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0)
        assert out.usage.completion_tokens == 3
        bad = openai.OpenAI(base_url=url, api_key="wrong-token", http_client=http, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=model, prompt="Hello", max_tokens=3)
        missing = http.post(url + "/completions", json={"model": model, "prompt": "Hello"})
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
        assert http.get(srv.http_url.replace("http://", "https://") + "/health").status_code == 200
    with pytest.raises(httpx.HTTPError):  # plaintext to the TLS port
        httpx.get(srv.http_url + "/health", timeout=10)


def test_the_token_is_never_logged(secured):
    _, _, handler = secured
    assert handler.lines, "the server logged nothing at all while starting"
    assert not any(TOKEN in line for line in handler.lines)

