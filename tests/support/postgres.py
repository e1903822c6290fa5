"""A throwaway PostgreSQL cluster for the tests: initdb in a temp dir, loopback only.

The binaries come from Debian's ``postgresql`` package (scripts/ensure-postgres.sh installs it).
PostgreSQL refuses to run as root, so as root the cluster runs as the ``postgres`` user.
"""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from tests.support.server import free_port

__all__ = ["PostgresCluster", "durable_database", "find_postgres_bin"]


def find_postgres_bin() -> Path | None:
    """The directory holding ``initdb`` and ``pg_ctl``, or None when PostgreSQL is missing."""
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), reverse=True)
    if candidates:
        return Path(candidates[0]).parent
    found = shutil.which("initdb")
    return Path(found).resolve().parent if found else None


class PostgresCluster:
    """One cluster; :meth:`create_database` hands out a fresh database per test server.

    Without ``fsync`` (the tests) the cluster does not wait for the disk: fast, not durable.
    """

    def __init__(self, bindir: Path, *, fsync: bool = False) -> None:
        self._bindir = bindir
        self._fsync = fsync
        self._root = Path(tempfile.mkdtemp(prefix="static-pg-"))
        self._data = self._root / "data"
        self.port = free_port()
        self._as_root = os.geteuid() == 0
        self._counter = itertools.count(1)
        if self._as_root:
            pw = pwd.getpwnam("postgres")
            os.chown(self._root, pw.pw_uid, pw.pw_gid)

    def _run(self, args: Sequence[str]) -> None:
        command = list(args)
        if self._as_root:
            command = ["runuser", "-u", "postgres", "--", *command]
        subprocess.run(command, check=True, capture_output=True, cwd=self._root)

    def start(self) -> None:
        self._run(
            [
                str(self._bindir / "initdb"),
                "-D",
                str(self._data),
                "-U",
                "postgres",
                "--auth=trust",
                "--no-sync",
                "-E",
                "UTF8",
            ]
        )
        self._start_server()

    def _start_server(self) -> None:
        options = (
            f"-c listen_addresses=127.0.0.1 -c port={self.port} "
            f"-c unix_socket_directories={self._root} -c fsync={'on' if self._fsync else 'off'} "
            "-c max_connections=200 -c shared_buffers=64MB"
        )
        self._run(
            [
                str(self._bindir / "pg_ctl"),
                "-D",
                str(self._data),
                "-o",
                options,
                "-l",
                str(self._root / "server.log"),
                "-w",
                "start",
            ]
        )

    def restart(self, down_for: float) -> None:
        """An outage: stop the server (fast: every connection is cut), stay down ``down_for``
        seconds, start it again on the same data and port."""
        self._run([str(self._bindir / "pg_ctl"), "-D", str(self._data), "-m", "fast", "-w", "stop"])
        time.sleep(down_for)
        self._start_server()

    def down(self) -> None:
        """Stop the server (fast: every connection is cut), keeping its data for :meth:`up`."""
        self._run([str(self._bindir / "pg_ctl"), "-D", str(self._data), "-m", "fast", "-w", "stop"])

    def up(self) -> None:
        """Start the server again after :meth:`down`, on the same data and port."""
        self._start_server()

    def stop(self) -> None:
        try:
            self._run(
                [str(self._bindir / "pg_ctl"), "-D", str(self._data), "-m", "immediate", "stop"]
            )
        finally:
            shutil.rmtree(self._root, ignore_errors=True)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        """Create an empty database; return its URL."""
        name = f"static_test_{os.getpid()}_{next(self._counter)}"
        self._run(
            [
                str(self._bindir / "psql"),
                "-h",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-U",
                "postgres",
                "-v",
                "ON_ERROR_STOP=1",
                "-c",
                f'CREATE DATABASE "{name}"',
            ]
        )
        return self.url(name)


@contextmanager
def durable_database() -> Iterator[str | None]:
    """For the benchmarks: a fresh database on a cluster of its own that flushes each commit to
    disk (as SQLite's ``synchronous=FULL`` does), stopped on exit; None when PostgreSQL is not
    installed (after saying so)."""
    bindir = find_postgres_bin()
    if bindir is None:
        print("postgresql: skipped (no PostgreSQL binaries: scripts/ensure-postgres.sh)")
        yield None
        return
    cluster = PostgresCluster(bindir, fsync=True)
    cluster.start()
    try:
        yield cluster.create_database()
    finally:
        cluster.stop()
