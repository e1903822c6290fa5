"""schemathesis (every check, every phase) against a real server, from its own OpenAPI document:
the document states what the server enforces, and the server keeps to the document."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.api import Api
from tests.support.server import ServerProcess

#: Bounded: a fixed seed and examples per operation. Measured on 2 busy cores: ~10 s with the
#: server's start (a run of 300 examples per operation, seed 7, also passed, in ~30 s).
EXAMPLES = 40
SEED = 1


def test_schemathesis_all_checks_pass(tmp_path: Path) -> None:
    # Limits off: schemathesis sends requests without credentials by the dozen (ignored_auth).
    server = ServerProcess(
        tmp_path / "server",
        f"sqlite:///{tmp_path / 'static.db'}",
        ("--signup-rate", "off", "--key-rate", "off", "--auth-failure-rate", "off"),
    ).start()
    try:
        api = Api(server.http_url)
        key = api.signup().key
        api.close()
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "schemathesis.cli",
                "run",
                f"{server.http_url}/v1/openapi.json",
                "--checks",
                "all",
                "--max-examples",
                str(EXAMPLES),
                "--seed",
                str(SEED),
                "--workers",
                "1",
                "--generation-database",
                "none",
                "--request-timeout",
                "10",
                "--header",
                f"Authorization: Bearer {key}",
                "--no-color",
            ],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=240,
        )
        assert run.returncode == 0, run.stdout[-20_000:] + run.stderr[-5_000:]
        assert "No issues found" in run.stdout, run.stdout[-5_000:]
        assert server.proc is not None and server.proc.poll() is None
    finally:
        code = server.stop()
    assert code == 0, server.stderr()
    assert "Traceback" not in server.stderr(), server.stderr()
