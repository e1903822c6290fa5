"""HTTP/1.1 edges below the app (static/api/_h11.py), with raw sockets on a real server:
CL+TE smuggling, JSON bodies on hypercorn's own errors, lingering close after a 413."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

import pytest

from static.api._h11 import LINGER_BYTES, LINGER_SECONDS
from tests.support.api import Api, RawResponse, open_raw, raw_request, read_response


def _assert_json_error(response: RawResponse, status: int, text: str | None = None) -> None:
    assert response.status == status, response
    assert response.headers["content-type"] == "application/json", response
    body = json.loads(response.body)
    assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"], body
    if text is not None:
        assert body["error"] == text


def _closed_by_server(sock: socket.socket, timeout: float = 5.0) -> bool:
    """Whether the server closes ``sock`` (EOF or reset) within ``timeout``; what it still
    sends first is read and dropped."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


SMUGGLED = (
    b"POST /v1/accounts HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
    b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"0\r\n\r\n"
    b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n"
)


def test_content_length_with_transfer_encoding_is_400_and_closed(api: Api) -> None:
    with open_raw(api.base_url) as sock:
        sock.sendall(SMUGGLED)
        response = read_response(sock)
        _assert_json_error(response, 400, "request has both content-length and transfer-encoding")
        assert response.headers["connection"] == "close"
        # No second response (the smuggled GET), and the connection ends.
        assert _closed_by_server(sock)
    # Either order of the two headers, any method.
    request = (
        b"GET /healthz HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n"
        b"Content-Length: 0\r\n\r\n0\r\n\r\n"
    )
    _assert_json_error(raw_request(api.base_url, request), 400)
    assert api.http.get("/healthz").status_code == 200


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GARBAGE\r\n\r\n", 400),
        (b"GET /healthz HTTP/1.1\r\nHost: t\r\nBad Header: x\r\n\r\n", 400),
        (b"POST /v1/accounts HTTP/1.1\r\nHost: t\r\nContent-Length: abc\r\n\r\n", 400),
        (b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n", 431),
        (b"POST /v1/accounts HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: gzip\r\n\r\n", 501),
    ],
    ids=["garbage", "bad-header-name", "bad-length", "huge-header", "gzip-coding"],
)
def test_errors_hypercorn_writes_itself_are_json(
    api: Api, request_bytes: bytes, status: int
) -> None:
    with open_raw(api.base_url) as sock:
        sock.sendall(request_bytes)
        response = read_response(sock)
        _assert_json_error(response, status)
        assert response.headers["connection"] == "close"
        assert _closed_by_server(sock)


@pytest.mark.parametrize("size", [65 * 1024, 900 * 1024])
def test_urllib_reads_the_413_of_a_body_over_the_limit(api: Api, size: int) -> None:
    # urllib writes the whole body before reading: without a lingering close it got a broken
    # pipe (or a reset) instead of the answer.
    request = urllib.request.Request(
        f"{api.base_url}/v1/accounts",
        data=b"x" * size,
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 413
    assert json.loads(refused.value.read()) == {"error": "request body too large"}


def test_the_body_sent_after_a_413_is_drained_then_the_connection_closes_cleanly(
    api: Api,
) -> None:
    # Deterministic form of the urllib case: the 413 is out before any of the body is sent.
    # Closing at once would make the kernel answer the body with a reset.
    with open_raw(api.base_url) as sock:
        sock.sendall(
            b"POST /v1/accounts HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: 500000\r\n\r\n"
        )
        _assert_json_error(read_response(sock), 413, "request body too large")
        # Still open: closing now would answer the body with a reset.
        sock.settimeout(0.3)
        with pytest.raises(TimeoutError):
            sock.recv(1, socket.MSG_PEEK)
        sock.sendall(b"x" * 500_000)
        # Closed once the body is in (not after the whole 2 s bound), with a clean EOF.
        sock.settimeout(LINGER_SECONDS - 0.5)
        assert sock.recv(1) == b""


def test_a_peer_that_keeps_sending_is_cut_off_by_bytes(api: Api) -> None:
    with open_raw(api.base_url) as sock:
        # A small send buffer: what was sent is close to what the server took.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
        sock.sendall(
            b"POST /v1/accounts HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000000\r\n\r\n"
        )
        sock.settimeout(0.5)
        sent, started, closed = 0, time.monotonic(), False
        chunk = b"x" * 65536
        # Far more than the bound, as fast as the server takes it: refused once the dropped
        # bytes pass LINGER_BYTES (what the kernel's buffers hold comes on top).
        while sent < 20 * LINGER_BYTES and time.monotonic() - started < 10:
            try:
                sent += sock.send(chunk)
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
        assert closed, f"still open after {sent} bytes"
        # Measured: 1.5-1.8 MiB (the bound, plus what the server's socket buffer took).
        assert sent < 6 * LINGER_BYTES


def test_a_peer_that_trickles_is_cut_off_by_time(api: Api) -> None:
    with open_raw(api.base_url) as sock:
        sock.sendall(
            b"POST /v1/accounts HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000000\r\n\r\n"
        )
        response = read_response(sock)
        _assert_json_error(response, 413, "request body too large")
        started = time.monotonic()
        sock.settimeout(0.2)
        closed = False
        while time.monotonic() - started < LINGER_SECONDS + 5:
            try:
                sock.send(b"x" * 100)
                if sock.recv(1) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
        waited = time.monotonic() - started
        assert closed, "the connection stayed open"
        assert LINGER_SECONDS - 0.5 <= waited <= LINGER_SECONDS + 3, waited
    assert api.http.get("/healthz").status_code == 200
