"""TLS on both ports of ``static serve`` (``--tls-cert``/``--tls-key``) and the SDK's ``ca_file``,
with a throwaway CA made here (trustme): the SDK end to end and the HTTP API over TLS, a wrong CA
and a plaintext server refused with a clear, final ``transport error:``, and the relay's TLS
port refusing plaintext at once and dropping a peer that never completes its handshake."""

from __future__ import annotations

import socket
import ssl
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import trustme

from static_sdk import StaticClient, TransportError
from tests.sdk.conftest import channel_name, next_within
from tests.support.server import ServerProcess, serve_once

#: What the SDK says when it does not trust the certificate (the relay's and the API's words).
NOT_TRUSTED = "TLS certificate"


@dataclass(frozen=True)
class Pki:
    """A CA, and the server certificate it issued for 127.0.0.1, as PEM files."""

    ca: Path
    cert: Path
    key: Path


def _pki(directory: Path) -> Pki:
    directory.mkdir()
    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1", "localhost")
    pki = Pki(directory / "ca.pem", directory / "cert.pem", directory / "key.pem")
    ca.cert_pem.write_to_path(str(pki.ca))
    issued.private_key_pem.write_to_path(str(pki.key))
    with pki.cert.open("wb") as chain:
        for blob in issued.cert_chain_pems:
            chain.write(blob.bytes())
    return pki


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return _pki(tmp_path / "pki")


@pytest.fixture
def other_ca(tmp_path: Path) -> Path:
    """A CA that issued nothing the server holds."""
    path = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(path))
    return path


@pytest.fixture
def tls_server(
    start_server: Callable[..., ServerProcess], pki: Pki
) -> Callable[..., ServerProcess]:
    def start(*extra: str) -> ServerProcess:
        return start_server("--tls-cert", str(pki.cert), "--tls-key", str(pki.key), *extra)

    return start


@pytest.fixture
def backend() -> str:
    return "sqlite"


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None, url
    return parts.hostname, parts.port


def _sign_up(server: ServerProcess, ca: Path) -> str:
    response = httpx.post(
        f"{server.http_url}/v1/accounts",
        json={"email": "tls@example.com"},
        verify=ssl.create_default_context(cafile=str(ca)),
    )
    assert response.status_code == 200, response.text
    key: str = response.json()["api_key"]
    return key


def test_the_sdk_end_to_end_over_tls(
    tls_server: Callable[..., ServerProcess], pki: Pki, tmp_path: Path
) -> None:
    server = tls_server()
    assert server.relay_url.startswith("https://127.0.0.1:"), server.relay_url
    assert server.http_url.startswith("https://127.0.0.1:"), server.http_url
    key = _sign_up(server, pki.ca)

    def client(name: str) -> StaticClient:
        return StaticClient(
            server.relay_url,
            tmp_path / name,
            name.encode(),
            api_key=key,
            api_url=server.http_url,
            ca_file=pki.ca,
        )

    with client("alice") as alice, client("bob") as bob:
        name = channel_name()
        channel = alice.create_channel(name)
        welcome = channel.add_member(bob.generate_key_package())
        bobs = bob.join_channel(name, welcome)
        channel.send(b"over tls")
        assert next_within(iter(bobs.messages())) == b"over tls"
        bobs.send(b"and back")
        assert next_within(iter(channel.messages())) == b"and back"


def test_the_ca_file_comes_from_the_environment_too(
    tls_server: Callable[..., ServerProcess],
    pki: Pki,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = tls_server()
    key = _sign_up(server, pki.ca)
    monkeypatch.setenv("STATIC_CA_FILE", str(pki.ca))
    with StaticClient(
        server.relay_url, tmp_path / "a", b"a", api_key=key, api_url=server.http_url
    ) as alice:
        alice.create_channel(channel_name())


def test_the_http_api_over_tls_speaks_http11_and_h2(
    tls_server: Callable[..., ServerProcess], pki: Pki
) -> None:
    server = tls_server()
    trusted = ssl.create_default_context(cafile=str(pki.ca))
    for http2, version in ((False, "HTTP/1.1"), (True, "HTTP/2")):
        with httpx.Client(verify=trusted, http2=http2) as http:
            response = http.get(f"{server.http_url}/healthz")
        assert response.status_code == 200
        assert response.http_version == version
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{server.http_url}/healthz")  # the system's roots do not know this CA


def test_a_wrong_ca_is_a_clear_final_transport_error(
    tls_server: Callable[..., ServerProcess], pki: Pki, other_ca: Path, tmp_path: Path
) -> None:
    server = tls_server("--allow-anonymous")
    key = _sign_up(server, pki.ca)
    # The API's certificate, at the key exchange.
    with pytest.raises(TransportError) as api:
        StaticClient(
            server.relay_url,
            tmp_path / "a",
            b"a",
            api_key=key,
            api_url=server.http_url,
            ca_file=other_ca,
        )
    text = str(api.value)
    assert text.startswith("transport error: the API's TLS certificate at https://"), text
    assert "was not trusted" in text and "ca_file" in text, text
    # The relay's (anonymous, so the relay is the first to be reached): final, so it fails at
    # once rather than after the connect timeout's retries.
    with StaticClient(
        server.relay_url, tmp_path / "b", b"b", ca_file=other_ca, connect_timeout=15
    ) as client:
        started = time.monotonic()
        with pytest.raises(TransportError) as relay:
            client.create_channel(channel_name())
        took = time.monotonic() - started
    text = str(relay.value)
    assert text.startswith("transport error: "), text
    assert "the relay's TLS certificate was not trusted" in text and "ca_file" in text, text
    assert took < 10, f"retried for {took:.1f} s: a certificate not trusted is final"


def test_a_self_signed_certificate_as_its_own_ca_gets_the_recipe_not_a_retry(
    start_server: Callable[..., ServerProcess], tmp_path: Path
) -> None:
    """A newcomer's first try: one self-signed certificate from ``openssl req -x509`` (a CA
    certificate, basicConstraints CA:TRUE) served, and given as ca_file too. rustls refuses a
    CA as the relay's own certificate (CaUsedAsEndEntity); the error says so and what to do,
    rather than "pass ca_file", which was done."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    made = subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    server = start_server("--tls-cert", str(cert), "--tls-key", str(key), "--allow-anonymous")
    with StaticClient(
        server.relay_url, tmp_path / "a", b"a", ca_file=cert, connect_timeout=15
    ) as client:
        started = time.monotonic()
        with pytest.raises(TransportError) as refused:
            client.create_channel(channel_name())
        took = time.monotonic() - started
    text = str(refused.value)
    assert "is a CA certificate (CaUsedAsEndEntity)" in text, text
    assert "leaf certificate signed by a CA" in text and "TLS with a private CA" in text, text
    assert took < 10, f"retried for {took:.1f} s: a refused certificate is final"


def test_a_plaintext_server_behind_https_is_a_clear_transport_error(
    start_server: Callable[..., ServerProcess], pki: Pki, tmp_path: Path
) -> None:
    server = start_server("--allow-anonymous")  # no TLS
    host, port = _address(server.relay_url)
    with StaticClient(
        f"https://{host}:{port}", tmp_path / "a", b"a", ca_file=pki.ca, connect_timeout=15
    ) as client:
        started = time.monotonic()
        with pytest.raises(TransportError, match="TLS") as relay:
            client.create_channel(channel_name())
        assert time.monotonic() - started < 10, str(relay.value)
    host, port = _address(server.http_url)
    with pytest.raises(TransportError) as api:
        StaticClient(
            server.relay_url,
            tmp_path / "b",
            b"b",
            api_key="sk_live_x",
            api_url=f"https://{host}:{port}",
            ca_file=pki.ca,
        )
    assert "the TLS handshake with the API at https://" in str(api.value), str(api.value)


def test_a_ca_file_that_cannot_be_read_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope.pem"
    with pytest.raises(TransportError, match=f"ca_file {missing}"):
        StaticClient("https://127.0.0.1:1", tmp_path / "a", b"a", ca_file=missing)
    empty = tmp_path / "empty.pem"
    empty.write_text("not a certificate\n")
    with pytest.raises(TransportError, match="holds no PEM certificate"):
        StaticClient("https://127.0.0.1:1", tmp_path / "b", b"b", ca_file=empty)


def _closed_within(sock: socket.socket, seconds: float) -> float:
    """Seconds until the peer closed ``sock`` (reading and discarding what it sends)."""
    started = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"still open after {seconds} s")
    return time.monotonic() - started


def test_the_relay_refuses_plaintext_on_its_tls_port_at_once(
    tls_server: Callable[..., ServerProcess],
) -> None:
    server = tls_server()
    with socket.create_connection(_address(server.relay_url), timeout=5) as sock:
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        # Well before the 10 s handshake timeout: the first bytes are not TLS.
        assert _closed_within(sock, 5) < 5


def _tls_connect(address: tuple[str, int], ca: Path) -> ssl.SSLSocket:
    context = ssl.create_default_context(cafile=str(ca))
    context.set_alpn_protocols(["h2"])
    sock = socket.create_connection(address, timeout=5)
    return context.wrap_socket(sock, server_hostname=address[0])


def test_a_peer_that_never_shakes_hands_holds_its_place_only_until_the_timeout(
    tls_server: Callable[..., ServerProcess], pki: Pki
) -> None:
    server = tls_server(
        "--relay-tls-handshake-timeout", "1", "--relay-max-connections-per-address", "2"
    )
    address = _address(server.relay_url)
    stalled = [socket.create_connection(address, timeout=5) for _ in range(2)]
    try:
        time.sleep(0.3)  # both accepted and admitted
        # The two silent peers hold this address's places: a third connection is closed.
        with socket.create_connection(address, timeout=5) as third:
            assert _closed_within(third, 0.9) < 0.9
        # Each is dropped at the handshake timeout, not the 60 s idle timeout...
        for sock in stalled:
            assert _closed_within(sock, 6) < 6
        # ...and gives its place back.
        with _tls_connect(address, pki.ca) as ok:
            assert ok.selected_alpn_protocol() == "h2"
    finally:
        for sock in stalled:
            sock.close()


def test_the_api_drops_a_peer_that_never_shakes_hands_at_the_timeout(
    tls_server: Callable[..., ServerProcess], pki: Pki
) -> None:
    # The API's handshake timeout is 10 s (ApiSettings; hypercorn's own default is 60 s).
    server = tls_server("--http-max-connections-per-address", "1")
    address = _address(server.http_url)
    with socket.create_connection(address, timeout=5) as stalled:
        time.sleep(0.3)
        # The silent peer holds this address's one place: another connection is closed.
        with socket.create_connection(address, timeout=5) as second:
            assert _closed_within(second, 2) < 2
        took = _closed_within(stalled, 20)
    assert 8 < took < 16, took
    trusted = ssl.create_default_context(cafile=str(pki.ca))
    assert httpx.get(f"{server.http_url}/healthz", verify=trusted).status_code == 200


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--tls-cert", "{cert}"), "--tls-cert and --tls-key go together"),
        (("--tls-key", "{key}"), "--tls-cert and --tls-key go together"),
        (("--tls-cert", "{missing}", "--tls-key", "{key}"), "cannot read {missing}"),
        (("--tls-cert", "{cert}", "--tls-key", "{missing}"), "cannot read {missing}"),
        (("--tls-cert", "{garbage}", "--tls-key", "{key}"), "{garbage} holds no PEM certificate"),
        (("--tls-cert", "{cert}", "--tls-key", "{garbage}"), "{garbage} holds no PEM private key"),
        (("--tls-cert", "{cert}", "--tls-key", "{other_key}"), "cannot serve TLS together"),
    ],
)
def test_bad_tls_files_are_a_config_error_naming_the_file(
    tmp_path: Path, pki: Pki, args: tuple[str, ...], says: str
) -> None:
    other = _pki(tmp_path / "other")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("hello\n")
    names = {
        "cert": pki.cert,
        "key": pki.key,
        "missing": tmp_path / "missing.pem",
        "garbage": garbage,
        "other_key": other.key,
    }
    result = serve_once(
        *("--data-dir", str(tmp_path / "data"), "--http", "127.0.0.1:0"),
        *("--relay", "127.0.0.1:0", *(arg.format(**names) for arg in args)),
    )
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith("static: ") and says.format(**names) in line, line
    assert not (tmp_path / "data").exists()
