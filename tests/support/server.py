"""A real ``static serve`` process on loopback ports, for the tests."""

from __future__ import annotations

import importlib
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["ServerProcess", "free_port", "restartable_args"]


def serve_once(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``static serve ARGS`` run to its end (a refused configuration), its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "static", "serve", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def free_port() -> int:
    """A loopback port nothing listens on (picked by the OS, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def restartable_args(*extra: str) -> tuple[str, ...]:
    """``static serve`` arguments with fixed ports, so that a restarted server is where its
    clients look for it."""
    return (*extra, "--relay", f"127.0.0.1:{free_port()}", "--http", f"127.0.0.1:{free_port()}")


class ServerProcess:
    """``python -m static serve`` with ports picked by the OS; restartable on the same data."""

    def __init__(
        self,
        data_dir: Path,
        database_url: str | None = None,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        python: str = sys.executable,
        cwd: Path | None = None,
    ) -> None:
        self.python = python
        self.cwd = cwd
        self.data_dir = data_dir
        self.database_url = database_url
        self.extra_args = list(extra_args)
        self.env = env or {}
        self.proc: subprocess.Popen[str] | None = None
        self.http_url = ""
        self.relay_url = ""
        self._stderr_path = data_dir / "server.stderr"

    def start(self, timeout: float = 30.0) -> ServerProcess:
        # Owner-only, as the server makes it: it warns about a data dir others can read.
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        args = [
            self.python,
            "-m",
            "static",
            "serve",
            "--http",
            "127.0.0.1:0",
            "--relay",
            "127.0.0.1:0",
            "--data-dir",
            str(self.data_dir),
        ]
        if self.database_url:
            args += ["--database", self.database_url]
        args += self.extra_args
        stderr = self._stderr_path.open("a")
        self.proc = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env={**os.environ, **self.env},
            cwd=self.cwd,
        )
        stderr.close()
        self.http_url = self.relay_url = ""
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        selector = selectors.DefaultSelector()
        selector.register(self.proc.stdout, selectors.EVENT_READ)
        # The server prints "http: URL" and "relay: URL" once both listen.
        expected = {"http"} | ({"relay"} if self._has_relay() else set())
        seen: set[str] = set()
        # Read the raw pipe: both lines may arrive in one chunk, and a buffered readline would
        # keep the second where select() cannot see it.
        pending = b""
        while seen != expected:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.kill()
                raise RuntimeError(f"server did not start:\n{self.stderr()}")
            if not selector.select(timeout=0.2):
                continue
            pending += os.read(self.proc.stdout.fileno(), 4096)
            while b"\n" in pending:
                raw, pending = pending.split(b"\n", 1)
                key, _, value = raw.decode(errors="replace").strip().partition(": ")
                if key == "http":
                    self.http_url = value
                elif key == "relay":
                    self.relay_url = value
                seen.add(key) if key in expected else None
        selector.close()
        return self

    @staticmethod
    def _has_relay() -> bool:
        # importlib, not an import statement: mypy must not need static.relay to exist.
        try:
            relay = importlib.import_module("static.relay")
        except ImportError:
            return False
        return hasattr(relay, "serve_relay")

    def stderr(self) -> str:
        try:
            return self._stderr_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, wait for the graceful exit; return the exit code."""
        if self.proc is None:
            return 0
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"server did not stop within {timeout}s:\n{self.stderr()}") from None
        finally:
            if proc.stdout is not None:
                proc.stdout.close()
        return code

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            self.proc = None

    def restart(self) -> ServerProcess:
        code = self.stop()
        assert code == 0, f"server exited with {code}:\n{self.stderr()}"
        return self.start()
