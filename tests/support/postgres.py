"""A throwaway PostgreSQL cluster for the tests: initdb in a temp dir, loopback only, ending
with the process that started it.

The binaries come from Debian's ``postgresql`` package (scripts/ensure-postgres.sh installs it).
PostgreSQL refuses to run as root, so as root the cluster runs as the ``postgres`` user.

The postmaster is this process's child, not ``pg_ctl``'s: ``pg_ctl`` detaches it into a session
of its own, so a run that was killed (the watchdog, ``scripts/test.sh``'s ``timeout``, a
SIGKILL) left its cluster running, port and temp dir included. As a child it gets SIGQUIT
(PostgreSQL's immediate shutdown) when its parent dies (``PR_SET_PDEATHSIG``), and a later
cluster removes the temp dirs of runs that are gone.

util-linux's ``setpriv`` (Debian: essential) switches the user and sets that signal, then
execs the postmaster. No Python runs between fork and exec: a ``preexec_fn`` (and Popen's own
``user=``) forks without vfork, and the fork handlers of the libraries the tests load (gRPC's)
then ran in a child of a threaded process: one segfaulted there, and the cluster never came
back from a restart.
"""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from tests.support.server import free_port

__all__ = ["PostgresCluster", "durable_database", "find_postgres_bin"]

#: What the postmaster gets when the thread that started it ends (prctl's PR_SET_PDEATHSIG,
#: set by setpriv after the user switch, which clears it): an immediate shutdown (it ends its
#: backends and exits).
_DEATH_SIGNAL = "QUIT"
#: The temp dirs' prefix; the creating pid follows, so a dead run's dir can be told apart.
_PREFIX = "static-pg-"
#: Bound on a start or a stop (both take well under a second).
_WAIT = 60.0


def _sweep_dead_runs() -> None:
    """Remove the temp dirs whose creating process is gone (a killed run's; its postmaster
    died with it)."""
    for path in Path(tempfile.gettempdir()).glob(f"{_PREFIX}*"):
        found = re.fullmatch(rf"{_PREFIX}(\d+)-.*", path.name)
        if found is None:
            continue
        try:
            os.kill(int(found[1]), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:
            pass  # alive, someone else's


def find_postgres_bin() -> Path | None:
    """The directory holding ``initdb`` and ``postgres``, or None when PostgreSQL is missing."""
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
        _sweep_dead_runs()
        self._root = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-"))
        self._data = self._root / "data"
        self.port = free_port()
        self._as_root = os.geteuid() == 0
        self._counter = itertools.count(1)
        self._postmaster: subprocess.Popen[bytes] | None = None
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
        """Start the postmaster as our child (see the module's text) and wait until it
        accepts connections, as ``pg_ctl -w`` did."""
        if threading.current_thread() is not threading.main_thread():
            # The death signal follows the thread that forked, not the process.
            raise RuntimeError("start the cluster from the main thread")
        command = [
            str(self._bindir / "postgres"),
            "-D",
            str(self._data),
            "-c",
            "listen_addresses=127.0.0.1",
            "-c",
            f"port={self.port}",
            "-c",
            f"unix_socket_directories={self._root}",
            "-c",
            f"fsync={'on' if self._fsync else 'off'}",
            "-c",
            "max_connections=200",
            "-c",
            "shared_buffers=64MB",
        ]
        user = ["--reuid=postgres", "--regid=postgres", "--clear-groups"] if self._as_root else []
        command = ["setpriv", *user, f"--pdeathsig={_DEATH_SIGNAL}", "--", *command]
        with open(self._root / "server.log", "ab") as log:
            self._postmaster = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self._root,
                # Not the terminal's Ctrl-C: the fixture stops it, after the servers.
                start_new_session=True,
            )
        deadline = time.monotonic() + _WAIT
        while not self._ready():
            if self._postmaster.poll() is not None:
                raise RuntimeError(
                    f"postgres exited with {self._postmaster.returncode}: {self.log()}"
                )
            if time.monotonic() > deadline:
                self._signal_and_wait(signal.SIGQUIT)
                raise RuntimeError(f"postgres not ready within {_WAIT:g} s: {self.log()}")
            time.sleep(0.05)

    def _ready(self) -> bool:
        """Whether the postmaster says it accepts connections (``postmaster.pid``'s status
        line, which ``pg_ctl -w`` reads)."""
        try:
            lines = (self._data / "postmaster.pid").read_text().splitlines()
        except OSError:
            return False
        return len(lines) >= 8 and lines[7].strip() == "ready"

    def log(self) -> str:
        """The server's log so far."""
        try:
            return (self._root / "server.log").read_text(errors="replace")
        except OSError:
            return ""

    @property
    def postmaster_pid(self) -> int | None:
        """The running postmaster's pid, or None when it is stopped."""
        if self._postmaster is None or self._postmaster.poll() is not None:
            return None
        return self._postmaster.pid

    def _signal_and_wait(self, signum: signal.Signals) -> None:
        """Stop the postmaster with ``signum`` (SIGINT: fast, every connection cut; SIGQUIT:
        immediate) and wait for it to exit."""
        postmaster, self._postmaster = self._postmaster, None
        if postmaster is None:
            return
        if postmaster.poll() is None:
            postmaster.send_signal(signum)
        try:
            postmaster.wait(_WAIT)
        except subprocess.TimeoutExpired:
            postmaster.kill()
            postmaster.wait()

    def restart(self, down_for: float) -> None:
        """An outage: stop the server (fast: every connection is cut), stay down ``down_for``
        seconds, start it again on the same data and port."""
        self.down()
        time.sleep(down_for)
        self._start_server()

    def down(self) -> None:
        """Stop the server (fast: every connection is cut), keeping its data for :meth:`up`."""
        self._signal_and_wait(signal.SIGINT)

    def up(self) -> None:
        """Start the server again after :meth:`down`, on the same data and port."""
        self._start_server()

    def stop(self) -> None:
        try:
            self._signal_and_wait(signal.SIGQUIT)
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
