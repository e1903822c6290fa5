"""Connections are bounded on both ports (docs/design.md §5, "Connections"): the relay closes
connections that hold no call, both ports cap connections overall and per client address while
the other port goes on answering, and ``static serve`` fits the caps in its open-file limit.

On SQLite only: none of this depends on the store.
"""

from __future__ import annotations

import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.relay.client import Relay, pb
from tests.relay.raw_h2 import RawH2
from tests.support.server import ServerProcess

Start = Callable[..., ServerProcess]
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


@pytest.fixture
def backend() -> str:
    return "sqlite"


def _address(url: str) -> tuple[str, int]:
    host, _, port = url.split("://", 1)[1].rpartition(":")
    return host, int(port)


def _connect(url: str, source: str = "127.0.0.1") -> socket.socket:
    """A TCP connection to ``url`` from the loopback address ``source``."""
    sock = socket.socket()
    sock.settimeout(5)
    sock.bind((source, 0))
    sock.connect(_address(url))
    return sock


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the peer closes ``sock`` within ``seconds`` (what it sends first is skipped)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            if not sock.recv(65536):
                return True
        except TimeoutError:
            return False
        except OSError:
            return True
    return False


def _relay_serves(url: str, source: str) -> socket.socket | None:
    """A relay connection from ``source`` that is served (the relay sends its SETTINGS and
    keeps it open), or None when the relay closed it at once."""
    sock = _connect(url, source)
    sock.sendall(PREFACE + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")  # an empty SETTINGS
    try:
        first = sock.recv(65536)
    except OSError:
        first = b""
    if not first:
        sock.close()
        return None
    assert first[3] == 4, "the relay's first frame is its SETTINGS"
    return sock


def _http_serves(url: str, source: str) -> socket.socket | None:
    """An HTTP connection from ``source`` that answers ``/healthz`` (and stays open), or None
    when the server closed it at once."""
    sock = _connect(url, source)
    try:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: static\r\n\r\n")
        answer = sock.recv(65536)
    except OSError:
        answer = b""
    if not answer:
        sock.close()
        return None
    assert answer.startswith(b"HTTP/1.1 200"), answer
    return sock


def test_relay_connections_without_calls_are_closed(start_server: Start) -> None:
    # Measured at e879e1d: 20 silent or preface-only connections were all open after 75 s.
    server = start_server(
        "--allow-anonymous", "--relay-idle-timeout", "0.5", "--relay-keepalive", "0.2"
    )
    with Relay(server.relay_url) as relay:
        relay.create("acme/idle/chat")
        sub = relay.subscribe("acme/idle/chat")  # a live call: its connection is not idle
        sub.wait_keepalives(1)
        started = time.monotonic()
        silent = _connect(server.relay_url)
        preface = _connect(server.relay_url)
        preface.sendall(PREFACE)
        settings = _connect(server.relay_url)
        settings.sendall(PREFACE + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        done = RawH2(server.relay_url)  # one call, then none
        stream = done.start("ListMembers", pb.ListMembersRequest(channel="acme/idle/chat"))
        deadline = time.monotonic() + 5
        while stream not in done.ended and time.monotonic() < deadline:
            assert done.pump(0.1)
        for what, sock in (("silent", silent), ("preface", preface), ("settings", settings)):
            assert _closed_within(sock, 5), f"the {what} connection stayed open"
            sock.close()
        # Its GOAWAY and the rest are read raw (the h2 library refuses frames after a GOAWAY).
        assert _closed_within(done.sock, 5), "the connection whose call was done stayed open"
        done.close()
        assert time.monotonic() - started >= 0.5
        time.sleep(1)
        seen = sub.keepalives
        sub.wait_keepalives(seen + 2)
        sub.cancel()


def test_both_ports_cap_connections_and_the_other_port_still_answers(
    start_server: Start,
) -> None:
    server = start_server(
        "--allow-anonymous",
        "--relay-max-connections=4",
        "--relay-max-connections-per-address=3",
        "--http-max-connections=4",
        "--http-max-connections-per-address=3",
    )
    relay, http = server.relay_url, server.http_url
    held = [_relay_serves(relay, "127.0.0.1") for _ in range(3)]
    assert all(held), "a connection within the caps was refused"
    assert _relay_serves(relay, "127.0.0.1") is None, "the 4th from one address was served"
    held.append(_relay_serves(relay, "127.0.0.2"))
    assert held[-1] is not None, "another address was refused"
    assert _relay_serves(relay, "127.0.0.3") is None, "the 5th overall was served"
    # The relay's port is full: the HTTP API answers as before (each of these is a /healthz).
    held_http = [_http_serves(http, "127.0.0.1") for _ in range(3)]
    assert all(held_http), "an HTTP connection within the caps was refused"
    assert _http_serves(http, "127.0.0.1") is None, "the 4th HTTP from one address was served"
    held_http.append(_http_serves(http, "127.0.0.2"))
    assert held_http[-1] is not None, "another address was refused"
    assert _http_serves(http, "127.0.0.3") is None, "the 5th HTTP overall was served"
    # Refused connections while full: at most one log line per port about them.
    for _ in range(20):
        assert _relay_serves(relay, "127.0.0.1") is None
        assert _http_serves(http, "127.0.0.1") is None
    stderr = server.stderr()
    assert stderr.count("relay: refused connections") == 1, stderr
    assert stderr.count("connection(s) over the caps") == 1, stderr
    # The HTTP port is full: the relay answers calls once a place is free there.
    for sock in held:
        assert sock is not None
        sock.close()
    deadline = time.monotonic() + 5
    while True:
        try:
            with Relay(relay) as client:
                client.create("acme/caps/chat")
            break
        except Exception:  # noqa: BLE001  (places come back as the relay sees the closes)
            assert time.monotonic() < deadline, "closed connections kept their places"
            time.sleep(0.1)
    for sock in held_http:
        assert sock is not None
        sock.close()


def _serve(tmp_path: Path, nofile: tuple[int, int], *args: str) -> subprocess.Popen[str]:
    # util-linux's prlimit sets the limit and execs: a preexec_fn would run Python in a forked
    # child of this threaded process (no vfork), where the loaded libraries' fork handlers
    # have crashed a child before (tests/support/postgres.py).
    return subprocess.Popen(
        [
            "prlimit",
            f"--nofile={nofile[0]}:{nofile[1]}",
            "--",
            sys.executable,
            "-m",
            "static",
            "serve",
            "--http",
            "127.0.0.1:0",
            "--relay",
            "127.0.0.1:0",
            "--data-dir",
            str(tmp_path),
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _started(proc: subprocess.Popen[str]) -> bool:
    """Whether the server started (then it is stopped), or exited."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("http: "):
        proc.wait(timeout=30)
        return False
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 0
    return True


def test_caps_fit_the_open_file_limit(tmp_path: Path) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 12_000:
        pytest.skip(f"needs an open-file hard limit of 12,000 (it is {hard})")
    # The soft limit is raised to the hard one: 10,000 + 1,000 + the reserve fit then.
    raised = _serve(
        tmp_path / "a",
        (1024, 12_000),
        "--relay-max-connections=10000",
        "--http-max-connections=1000",
    )
    assert _started(raised)
    # Caps that were set must fit as they are.
    too_many = _serve(tmp_path / "b", (2048, 2048), "--relay-max-connections=10000")
    assert not _started(too_many)
    assert too_many.returncode == 2
    assert too_many.stderr is not None
    said = too_many.stderr.read()
    assert "need" in said and "ulimit -n" in said, said
    # Unset, they are lowered to fit.
    fitted = _serve(tmp_path / "c", (2048, 2048))
    assert _started(fitted)
