"""TLS and a bearer token on both client APIs, through the real grpc, httpx and openai clients.

A server with a self-signed certificate and a token (from a file) serves the right
client; a client without the token, with a wrong one, or in plaintext is refused; the
health checks answer without a token; the token is never logged.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import socket
import ssl
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.cluster.cli import main
from pdserve.cluster.clients.credentials import ClientCredentials
from pdserve.cluster.clients.grpc_client import Client
from pdserve.engine.sampling import SamplingParams
from pdserve.proto.v1 import generation_pb2 as pb
from pdserve.proto.v1 import generation_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

TOKEN = "s3cret-test-token-0123456789"
GREEDY = SamplingParams(temperature=0.0, max_tokens=3)


def _self_signed(folder: Path) -> tuple[Path, Path]:
    """A self-signed server certificate for localhost and 127.0.0.1 (its own CA)."""
    cert, key = _certificate("localhost", server=True)
    return _write(folder, "cert", cert, key)


def _certificate(common_name: str, issuer: tuple[Any, Any] | None = None, server: bool = False,
                 ca: bool = True) -> tuple[Any, Any]:
    """(certificate, key): self-signed when `issuer` (its certificate, key) is None."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    issuer_name, signer = (name, key) if issuer is None else (issuer[0].subject, issuer[1])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer_name).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    if not ca:
        builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    return builder.sign(signer, hashes.SHA256()), key


def _write(folder: Path, stem: str, cert: Any, key: Any) -> tuple[Path, Path]:
    from cryptography.hazmat.primitives import serialization

    cert_path, key_path = folder / f"{stem}.pem", folder / f"{stem}-key.pem"
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
    with Client(srv.target, ClientCredentials(srv.config.server.tls_cert, api_key=TOKEN)) as client:
        out = [t for r in client.generate("Hello", GREEDY, timeout_s=120) for t in r.token_ids]
        assert len(out) == 3
        assert client.list_models().models


@pytest.mark.parametrize("api_key", [None, "wrong-token", TOKEN + "x"])
def test_grpc_without_the_right_token_is_unauthenticated(secured, api_key):
    srv, ca, _ = secured
    with Client(srv.target, ClientCredentials(srv.config.server.tls_cert, api_key=api_key)) as client:
        assert _code(client.generate("Hello", GREEDY, timeout_s=30)) == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            client.server_info()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_grpc_plaintext_is_refused_and_health_needs_no_token(secured):
    srv, ca, _ = secured
    with Client(srv.target, ClientCredentials(api_key=TOKEN)) as plain:
        assert _code(plain.generate("Hello", GREEDY, timeout_s=10)) == grpc.StatusCode.UNAVAILABLE
    with grpc.secure_channel(srv.target, grpc.ssl_channel_credentials(ca)) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        # A raw stub with metadata of its own, as any gRPC client would send it.
        stub = pb_grpc.GenerationStub(channel)
        info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10,
                                  metadata=(("authorization", f"Bearer {TOKEN}"),))
        assert info.workers


def _openai_serves_the_token_only(http: httpx.Client, url: str) -> str:
    """The official client with the token is served; with a wrong one it gets AuthenticationError.
    Returns the model's id."""
    good = openai.OpenAI(base_url=url, api_key=TOKEN, http_client=http, max_retries=0)
    model = good.models.list().data[0].id
    out = good.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3
    bad = openai.OpenAI(base_url=url, api_key="wrong-token", http_client=http, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=model, prompt="Hello", max_tokens=3)
    return model


def test_openai_client_over_https_with_the_token(secured):
    srv = secured[0]
    url = srv.http_url.replace("http://", "https://") + "/v1"
    with httpx.Client(verify=ssl.create_default_context(cafile=srv.config.server.tls_cert)) as http:
        model = _openai_serves_the_token_only(http, url)
        missing = http.post(url + "/completions", json={"model": model, "prompt": "Hello"})
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
        assert http.get(srv.http_url.replace("http://", "https://") + "/health").status_code == 200
    with pytest.raises(httpx.HTTPError):  # plaintext to the TLS port
        httpx.get(srv.http_url + "/health", timeout=10)


def test_the_token_is_never_logged(secured):
    _, _, handler = secured
    assert handler.lines, "the server logged nothing at all while starting"
    assert not any(TOKEN in line for line in handler.lines)



# Mutual TLS: the server asks for a client certificate signed by its client CA, and a token.


@dataclass(frozen=True)
class _Mutual:
    srv: Any
    server_ca: Path  # the server's self-signed certificate, which clients trust
    client: tuple[Path, Path]  # certificate and key signed by the client CA
    stranger: tuple[Path, Path]  # the same from another CA


@pytest.fixture(scope="module")
def mutual(start, tmp_path_factory) -> _Mutual:
    folder = tmp_path_factory.mktemp("mtls")
    cert, key = _self_signed(folder)
    client_ca = _certificate("pdserve test client CA")
    other_ca = _certificate("some other CA")
    client_ca_file, _ = _write(folder, "client-ca", *client_ca)
    client = _write(folder, "client", *_certificate("client", issuer=client_ca, ca=False))
    stranger = _write(folder, "stranger", *_certificate("client", issuer=other_ca, ca=False))
    token_file = folder / "token"
    token_file.write_text(TOKEN)
    srv = start(pools={"mode": "colocated"},
                server={"tls_cert": str(cert), "tls_key": str(key), "tls_client_ca": str(client_ca_file),
                        "api_key_file": str(token_file)})
    return _Mutual(srv, cert, client, stranger)


def _mutual_channel(m: _Mutual, client: tuple[Path, Path] | None) -> grpc.Channel:
    key_cert = {} if client is None else {"certificate_chain": client[0].read_bytes(),
                                          "private_key": client[1].read_bytes()}
    return grpc.secure_channel(m.srv.target, grpc.ssl_channel_credentials(m.server_ca.read_bytes(), **key_cert))


def _generate(channel: grpc.Channel, token: str | None) -> list[pb.GenerateResponse]:
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    req = pb.GenerateRequest(prompt="Hello", sampling=pb.SamplingParams(temperature=0.0, max_tokens=3))
    return list(pb_grpc.GenerationStub(channel).Generate(req, timeout=120, metadata=metadata))


def test_grpc_mutual_tls_serves_a_certificate_of_the_client_ca_with_the_token(mutual):
    with _mutual_channel(mutual, mutual.client) as channel:
        assert sum(len(r.token_ids) for r in _generate(channel, TOKEN)) == 3
        with pytest.raises(grpc.RpcError) as err:  # the certificate does not replace the token
            _generate(channel, None)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("who", ["no certificate", "another CA's certificate"])
def test_grpc_mutual_tls_refuses_other_clients_in_the_handshake(mutual, who):
    client = None if who == "no certificate" else mutual.stranger
    with _mutual_channel(mutual, client) as channel:
        with pytest.raises(grpc.RpcError) as err:
            _generate(channel, TOKEN)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as err:  # not even the health check: no TLS session at all
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def _https(m: _Mutual, client: tuple[Path, Path] | None) -> httpx.Client:
    context = ssl.create_default_context(cafile=str(m.server_ca))
    if client is not None:
        context.load_cert_chain(str(client[0]), str(client[1]))
    return httpx.Client(verify=context, timeout=120)


def _https_url(m: _Mutual) -> str:
    return m.srv.http_url.replace("http://", "https://")


def test_openai_client_over_mutual_tls_with_the_token(mutual):
    url = _https_url(mutual) + "/v1"
    with _https(mutual, mutual.client) as http:
        _openai_serves_the_token_only(http, url)
        assert http.get(_https_url(mutual) + "/health").status_code == 200


@pytest.mark.parametrize("who", ["no certificate", "another CA's certificate"])
def test_http_mutual_tls_refuses_other_clients_in_the_handshake(mutual, who):
    client = None if who == "no certificate" else mutual.stranger
    with _https(mutual, client) as http:
        # TLS 1.3: the client's side of the handshake ends before the server checks its
        # certificate, so httpx sees the connection cut before any response.
        with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
            http.get(_https_url(mutual) + "/health")
    assert _raw_https_get(mutual, client) == b""  # not a byte of HTTP came back


def _raw_https_get(m: _Mutual, client: tuple[Path, Path] | None) -> bytes:
    """GET /health over a bare TLS socket: the first bytes of the answer, b"" when the server
    closed the connection (or refused the TLS session) instead."""
    context = ssl.create_default_context(cafile=str(m.server_ca))
    if client is not None:
        context.load_cert_chain(str(client[0]), str(client[1]))
    with socket.create_connection(("127.0.0.1", m.srv.server.http_port), timeout=10) as raw:
        try:
            with context.wrap_socket(raw, server_hostname="localhost") as tls:
                tls.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
                return tls.recv(64)
        except (ssl.SSLError, ConnectionError):
            return b""


def test_the_raw_tls_check_sees_an_answer_with_the_right_certificate(mutual):
    assert _raw_https_get(mutual, mutual.client).startswith(b"HTTP/1.1 200")


def _credential_flags(m: _Mutual, client: tuple[Path, Path] | None, token_file: Path) -> list[str]:
    flags = ["--tls-ca", str(m.server_ca), "--api-key-file", str(token_file)]
    return flags + ([] if client is None else ["--tls-client-cert", str(client[0]), "--tls-client-key", str(client[1])])


@pytest.mark.parametrize("api", ["grpc", "http"])
def test_pdserves_own_clients_present_a_client_certificate(mutual, api, tmp_path, capsys):
    """`pdserve generate`, `info` and `bench` over mutual TLS with the token: served with the
    client CA's certificate, refused without one."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    target = _https_url(mutual) if api == "http" else mutual.srv.target
    flags = _credential_flags(mutual, mutual.client, token_file)
    assert main(["generate", "--target", target, "--max-tokens", "3", "--temperature", "0", *flags, "Hello"]) == 0
    assert capsys.readouterr().out.strip()
    assert main(["bench", "--target", target, "--num-prompts", "2", "--input-len", "8", "--output-len", "2",
                 "--vocab-size", "1000", "--no-progress", *flags]) == 0
    assert "Successful requests" in capsys.readouterr().out
    if api == "grpc":
        assert main(["info", "--target", target, *flags]) == 0
        assert "colocated" in capsys.readouterr().out
    no_certificate = _credential_flags(mutual, None, token_file)
    assert main(["generate", "--target", target, "--max-tokens", "3", *no_certificate, "Hello"]) == 1
    assert "error" in capsys.readouterr().err


def test_a_client_certificate_without_its_key_is_a_clear_error(mutual, capsys):
    assert main(["info", "--target", mutual.srv.target, "--tls-client-cert", str(mutual.client[0])]) == 2
    assert "--tls-client-cert and --tls-client-key together" in capsys.readouterr().err


def test_a_client_ca_without_the_servers_own_tls_is_refused():
    from pdserve.cluster.settings.config import config_from_dict

    with pytest.raises(ValueError, match="tls_client_ca .* set tls_cert and tls_key"):
        config_from_dict({"server": {"tls_client_ca": "/etc/ca.pem"}})


@pytest.mark.parametrize("problem", ["missing", "not PEM"])
def test_an_unusable_client_ca_stops_pdserve_serve_at_start(tmp_path, problem):
    cert, key = _self_signed(tmp_path)
    ca = tmp_path / "ca.pem"
    if problem == "not PEM":
        ca.write_text("not a certificate\n")
    proc = subprocess.run([sys.executable, "-m", "pdserve.cluster.cli", "serve", "--port", "0", "--http-port", "0",
                           "--metrics-port", "0", "--tls-cert", str(cert), "--tls-key", str(key),
                           "--tls-client-ca", str(ca)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    expected = ("pdserve: error: cannot read the client CA file (server.tls_client_ca)" if problem == "missing"
                else "pdserve: error: the client CA file (server.tls_client_ca)")
    assert expected in proc.stderr and str(ca) in proc.stderr, proc.stderr
    if problem == "not PEM":
        assert "holds no PEM certificate" in proc.stderr, proc.stderr
