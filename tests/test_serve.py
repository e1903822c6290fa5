"""``static serve``: the process contract of docs/design.md §1 (bound URLs, health, graceful
exit)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.support.server import ServerProcess, serve_once


def test_serves_health_and_exits_cleanly_on_sigterm(server: ServerProcess) -> None:
    assert server.http_url.startswith("http://127.0.0.1:")
    response = httpx.get(f"{server.http_url}/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}
    assert server.stop() == 0


def test_restart_on_the_same_database(server: ServerProcess) -> None:
    first = server.http_url
    server.restart()
    assert httpx.get(f"{server.http_url}/healthz").status_code == 200
    assert first.startswith("http://")


def test_unknown_route_is_json_404(server: ServerProcess) -> None:
    response = httpx.get(f"{server.http_url}/nope")
    assert response.status_code == 404
    assert response.headers["content-type"].startswith("application/json")
    assert "error" in response.json()


def test_bad_arguments_exit_2() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "static", "serve", "--http", "nonsense"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert "HOST:PORT" in result.stderr


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--relay-keepalive", "0.01", "--relay-keepalive must be between 0.05 and 300"),
        ("--relay-publish-rate", "-1", "--relay-publish-rate must be >= 0"),
        ("--relay-max-streams", "0", "--relay-max-streams must be between 1 and 10,000"),
        ("--relay-max-subscriptions", "0", "must be between 1 and 1,000,000"),
        ("--relay-max-follows", "100000001", "must be between 1 and 100,000,000"),
        ("--relay-idle-timeout", "0", "--relay-idle-timeout must be between 0.05 and 86,400"),
        ("--relay-max-connections", "0", "must be between 1 and 10,000,000"),
        ("--relay-max-connections-per-address", "0", "must be between 1 and 10,000,000"),
        ("--relay-stream-buffer", "1000", "must be between 1,024 and 1,073,741,824"),
        ("--http-max-connections", "0", "--http-max-connections must be between 1 and"),
        ("--http-max-connections-per-address", "0", "must be between 1 and 10,000,000"),
    ],
)
def test_relay_options_out_of_bounds_exit_2(
    tmp_path: Path, flag: str, value: str, says: str
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "static", "serve", "--data-dir", str(tmp_path), flag, value],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert says in result.stderr


@pytest.mark.parametrize(
    ("database", "says"),
    [
        ("sqlite:///:memory:", "cannot be shared"),
        ("sqlite:///", "cannot be shared"),
        ("mysql://localhost/static", "unsupported database URL"),
    ],
)
def test_a_database_the_relay_cannot_open_is_a_config_error(
    tmp_path: Path, database: str, says: str
) -> None:
    # The relay opens the store's database itself: a SQLite database in memory would be another
    # (empty) one there. Refused before anything listens, like any other bad argument.
    result = serve_once(
        *("--database", database, "--data-dir", str(tmp_path)),
        *("--http", "127.0.0.1:0", "--relay", "127.0.0.1:0"),
    )
    assert result.returncode == 2
    assert result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith("static: ") and says in line and repr(database) in line


def test_a_relay_port_taken_is_one_line_and_exit_1(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "static",
                "serve",
                "--data-dir",
                str(tmp_path),
                "--http",
                "127.0.0.1:0",
                "--relay",
                f"127.0.0.1:{port}",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if "[INFO]" not in line]
    expected = f"static serve: cannot listen on 127.0.0.1:{port}: address already in use"
    assert errors == [expected], result.stderr
