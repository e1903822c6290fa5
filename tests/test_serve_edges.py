"""``static serve``'s process edges: ``--version``, one server per SQLite database (a lock),
owner-only data files, and a taken port named in the error."""

from __future__ import annotations

import importlib.metadata
import os
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.server import ServerProcess, serve_once


def _errors(stderr: str) -> list[str]:
    """The command's own lines of stderr (``static...: ``), not the log's."""
    return [line for line in stderr.splitlines() if line.startswith("static")]


def test_version_prints_the_package_version() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "static", "--version"], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"static {importlib.metadata.version('static-mls')}\n"


@pytest.fixture
def running(tmp_path: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(tmp_path / "data").start()
    try:
        yield server
    finally:
        assert server.stop() == 0, server.stderr()


def test_a_second_server_on_the_same_sqlite_database_refuses_to_start(
    running: ServerProcess, tmp_path: Path
) -> None:
    database = running.data_dir / "static.db"
    result = serve_once(
        "--data-dir", str(running.data_dir), "--http", "127.0.0.1:0", "--relay", "127.0.0.1:0"
    )
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    [line] = _errors(result.stderr)
    assert line.startswith("static serve: the database ") and str(database) in line, line
    assert "in use by another static serve" in line, line
    # The same file named from another data dir is the same database.
    result = serve_once(
        "--data-dir",
        str(tmp_path / "elsewhere"),
        "--database",
        f"sqlite:///{database}",
        "--http",
        "127.0.0.1:0",
        "--relay",
        "127.0.0.1:0",
    )
    assert result.returncode == 2 and str(database) in result.stderr, result.stderr
    # The first one is untouched.
    assert httpx.get(f"{running.http_url}/healthz").status_code == 200
    # And once it is gone, the database is free again.
    assert running.stop() == 0
    running.start()
    assert httpx.get(f"{running.http_url}/healthz").status_code == 200


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_fresh_data_dir_and_its_files_are_owner_only(running: ServerProcess) -> None:
    data = running.data_dir
    # Some traffic, so that SQLite has made its -wal and -shm files (the relay's writer too).
    assert httpx.post(f"{running.http_url}/v1/accounts", json={"email": "m@x.io"}).is_success
    names = {
        *(
            f"{db}{suffix}"
            for db in ("static.db", "static-relay.db")
            for suffix in ("", "-wal", "-shm")
        ),
        "static.db.lock",
    }
    assert names <= {path.name for path in data.iterdir()}, sorted(data.iterdir())
    for name in names:
        assert _mode(data / name) == 0o600, (name, oct(_mode(data / name)))
    assert "open to group or others" not in running.stderr()


def test_the_server_creates_its_data_dir_owner_only(tmp_path: Path) -> None:
    data = tmp_path / "fresh" / "data"
    server = ServerProcess(tmp_path / "logs")
    server.extra_args = ["--data-dir", str(data)]  # the later flag wins
    server.start()
    try:
        assert _mode(data) == 0o700
        assert _mode(data / "static.db") == 0o600
        assert "open to group or others" not in server.stderr()
    finally:
        assert server.stop() == 0


def test_an_existing_data_dir_others_can_read_gets_a_warning(tmp_path: Path) -> None:
    data = tmp_path / "shared"
    data.mkdir()
    os.chmod(data, 0o755)
    server = ServerProcess(data).start()
    try:
        assert httpx.get(f"{server.http_url}/healthz").status_code == 200
    finally:
        assert server.stop() == 0
    warning = [line for line in server.stderr().splitlines() if "open to group or others" in line]
    assert warning and str(data) in warning[0] and "chmod 700" in warning[0], server.stderr()
    assert _mode(data) == 0o755  # warned about, not changed


@pytest.mark.parametrize("port", ["--http", "--metrics"])
def test_a_port_taken_is_named_in_one_line(tmp_path: Path, port: str) -> None:
    # The relay's: tests/test_serve.py.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        ports = {"--http": "127.0.0.1:0", "--relay": "127.0.0.1:0", port: address}
        ports.setdefault("--metrics", "127.0.0.1:0")
        result = serve_once("--data-dir", str(tmp_path), *(x for kv in ports.items() for x in kv))
    assert result.returncode == 1, result.stderr
    assert _errors(result.stderr) == [
        f"static serve: cannot listen on {address}: address already in use"
    ], result.stderr
