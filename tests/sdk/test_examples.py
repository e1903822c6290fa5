"""Each example in examples/ runs against a real server (so they keep working)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.api import Api
from tests.support.server import ServerProcess

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("example", ["blocking_agents.py", "trio_agents.py", "asyncio_agents.py"])
def test_example_runs(relay: ServerProcess, tmp_path: Path, example: str) -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / example),
            "--relay",
            relay.relay_url,
            "--data-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "bob got: question 0" in lines
    assert "alice got: answer to question 2" in lines
    assert "bob got: bye" in lines
    assert lines[-1] == "done"


def test_example_with_an_api_key(relay: ServerProcess, tmp_path: Path) -> None:
    api = Api(relay.http_url)
    try:
        key = api.signup().key
    finally:
        api.close()
    result = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "blocking_agents.py"),
            "--relay",
            relay.relay_url,
            "--api-url",
            relay.http_url,
            "--data-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, "STATIC_API_KEY": key},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "done"


@pytest.mark.parametrize("example", ["blocking_agents.py", "trio_agents.py", "asyncio_agents.py"])
def test_a_failing_example_exits_non_zero(tmp_path: Path, example: str) -> None:
    """No relay listens there: the example fails, says why, and its exit code says so."""
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    result = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / example),
            "--relay",
            f"grpc://127.0.0.1:{port}",
            "--data-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, "STATIC_SDK_CONNECT_TIMEOUT": "0.5"},
    )
    assert result.returncode != 0, result.stdout
    assert "transport error: cannot reach the relay" in result.stderr
    assert "done" not in result.stdout.splitlines()


def test_two_accounts_meet_through_invitations(relay: ServerProcess, tmp_path: Path) -> None:
    """examples/invitations.py: two processes, two accounts, no side channel but an address."""
    api = Api(relay.http_url)
    try:
        alice, bob = api.signup(), api.signup()
    finally:
        api.close()
    script = str(EXAMPLES / "invitations.py")
    env = {**os.environ, "STATIC_RELAY_URL": relay.relay_url, "STATIC_API_URL": relay.http_url}
    bobs = subprocess.Popen(
        [sys.executable, script, "bob", str(tmp_path / "bob")],
        env={**env, "STATIC_API_KEY": bob.key},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert bobs.stdout is not None
        address = bobs.stdout.readline().strip()
        assert address.startswith(f"static:{bob.id}:"), bobs.stderr.read() if bobs.stderr else ""
        alices = subprocess.run(
            [sys.executable, script, "alice", str(tmp_path / "alice"), address],
            env={**env, "STATIC_API_KEY": alice.key},
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert alices.returncode == 0, alices.stderr
        assert alices.stdout.splitlines() == [f"bob says: hi {alice.id}"]
        assert bobs.wait(timeout=30) == 0
    finally:
        bobs.kill()
        bobs.wait()
