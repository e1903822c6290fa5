"""HTTP/1.1 edges below the app (static/api/_h11.py), with raw sockets on a real server:
CL+TE smuggling, heads over 16 KiB, JSON bodies on hypercorn's own errors, lingering close after
a 413 (bounded by time)."""

from __future__ import annotations

import contextlib
import json
import socket
import time
import urllib.error
import urllib.request

import pytest

from static.api._h11 import LINGER_BYTES, LINGER_IDLE_SECONDS, LINGER_SECONDS
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


def _head(total: int) -> bytes:
    """A complete GET /healthz head of exactly ``total`` bytes (one big header)."""
    start, end = b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Big: ", b"\r\n\r\n"
    return start + b"a" * (total - len(start) - len(end)) + end


@pytest.mark.parametrize("reads", [1, 2], ids=["one-read", "completed-by-a-later-read"])
def test_a_complete_head_over_16_kib_is_431(api: Api, reads: int) -> None:
    # h11 bounds only a head it still waits for: a complete 40,000-byte head, whether it came
    # in one read or its last read completed it, was answered 200 before the server measured it.
    head = _head(40_000)
    with open_raw(api.base_url) as sock:
        if reads == 2:
            sock.sendall(head[:12_000])  # under the limit: h11 waits for the rest
            time.sleep(0.3)  # so that the server reads the two parts apart
        sock.sendall(head[12_000:] if reads == 2 else head)
        response = read_response(sock)
        _assert_json_error(response, 431, "request header fields too large")
        assert response.headers["connection"] == "close"
        assert _closed_by_server(sock)


def test_a_head_of_16_kib_is_served_and_the_connection_kept(api: Api) -> None:
    with open_raw(api.base_url) as sock:
        for _ in range(2):  # the bound is per request head, not per connection
            sock.sendall(_head(16 * 1024))
            assert read_response(sock).status == 200


@pytest.mark.parametrize("size", [65 * 1024, 900 * 1024, 8 << 20], ids=["65K", "900K", "8M"])
def test_urllib_reads_the_413_of_a_body_over_the_limit(api: Api, size: int) -> None:
    # urllib writes the whole body before reading: without a lingering close it got a broken
    # pipe (or a reset) instead of the answer; with one bounded at 1 MiB, so did 8 MiB.
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


def _send_413_head(sock: socket.socket) -> None:
    """A request head announcing a body far over the limit, then its 413."""
    sock.sendall(
        b"POST /v1/accounts HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000000000\r\n\r\n"
    )
    _assert_json_error(read_response(sock), 413, "request body too large")


def _send_until_closed(sock: socket.socket, chunk: bytes, pause: float, within: float) -> int:
    """Send ``chunk`` every ``pause`` seconds until the server closes the connection (or
    ``within`` seconds pass); the bytes sent."""
    sock.settimeout(0.5)
    sent, started = 0, time.monotonic()
    while time.monotonic() - started < within:
        try:
            sent += sock.send(chunk)
            if pause:
                time.sleep(pause)
                sock.settimeout(0)
                with contextlib.suppress(BlockingIOError):
                    if sock.recv(1) == b"":
                        return sent
                sock.settimeout(0.5)
        except TimeoutError:
            continue
        except (BrokenPipeError, ConnectionResetError):
            return sent
    raise AssertionError(f"still open after {sent} bytes in {within:g} s")


def test_a_peer_that_sends_fast_is_cut_off_by_bytes(api: Api) -> None:
    with open_raw(api.base_url) as sock:
        # A small send buffer: what was sent is close to what the server took.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
        _send_413_head(sock)
        started = time.monotonic()
        sent = _send_until_closed(sock, b"x" * 65536, 0, LINGER_SECONDS + 5)
        took = time.monotonic() - started
        # Over loopback the server reads the byte cap well within the time bound (measured:
        # 64 MiB in about 0.3 s); the kernel's buffers hold a few MiB more.
        assert LINGER_BYTES <= sent < LINGER_BYTES + (16 << 20), sent
        assert took < LINGER_SECONDS, took
    assert api.http.get("/healthz").status_code == 200


def test_a_peer_that_sends_forever_is_cut_off_by_time(api: Api) -> None:
    with open_raw(api.base_url) as sock:
        _send_413_head(sock)
        started = time.monotonic()
        # 1 KB every 0.1 s: never idle, never near the byte cap.
        _send_until_closed(sock, b"x" * 1000, 0.1, LINGER_SECONDS + 5)
        waited = time.monotonic() - started
        assert LINGER_SECONDS - 0.5 <= waited <= LINGER_SECONDS + 3, waited
    assert api.http.get("/healthz").status_code == 200


def test_a_peer_that_stops_sending_is_cut_off_when_idle(api: Api) -> None:
    with open_raw(api.base_url) as sock:
        _send_413_head(sock)
        started = time.monotonic()
        sock.sendall(b"x" * 1000)
        assert _closed_by_server(sock, LINGER_IDLE_SECONDS + 3)
        waited = time.monotonic() - started
        assert LINGER_IDLE_SECONDS - 0.5 <= waited <= LINGER_IDLE_SECONDS + 2, waited
    assert api.http.get("/healthz").status_code == 200
