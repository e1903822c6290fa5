"""The suite's backstop against hangs: a watchdog process ends the run when one phase of a test
(setup, call or teardown) outlasts the test's timeout, after printing which test and phase, the
native stacks (gdb, when installed) and every Python thread's stack, and stops what the run
started.

pytest-timeout alone did not (issue 28): its timer is cancelled by ``pytest_exception_interact``,
which pytest calls for every failure, not only under ``--pdb``, so a test that failed and then
hung in its teardown had no timer left (a CI run sat in ``StaticClient.close`` for over 10
minutes). Its ``thread`` method also needs the GIL to print and exit, which a native call that
keeps the GIL never gives back. So the timer lives in another process and needs nothing from
this one. It sends SIGUSR2, on which faulthandler prints every thread's stack from C, GIL or
not, and then lets the signal's default action end the process (chained: unchained, the signal
only interrupted the hung call, and the run went on and passed); SIGKILL if need be.
pytest-timeout still supplies the setting (``timeout``, ``--timeout``,
``@pytest.mark.timeout``); its own timer is not started.

Run as ``python -m tests.support.watchdog PID`` it is the watchdog: it reads ``arm SECONDS
LABEL`` and ``disarm`` lines on stdin, and ends when stdin does (the run is over).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Generator
from pathlib import Path
from typing import IO, Any

import pytest

__all__ = ["install", "timeout_of"]

ROOT = Path(__file__).resolve().parents[2]

#: The signal on which the run prints every thread's stack (faulthandler), then ends (its
#: default action: no core file).
DUMP_SIGNAL = signal.SIGUSR2
#: Seconds the run gets to end after its stacks before SIGKILL, and its children after SIGTERM.
GRACE = 3.0
#: Bound on gdb's native stacks (a few seconds in tests/test_hang_backstop.py).
GDB_SECONDS = 60.0


def timeout_of(item: pytest.Item) -> float:
    """The item's timeout in seconds as pytest-timeout reads it (its marker, ``--timeout``,
    ``PYTEST_TIMEOUT``, the ``timeout`` setting); 0 for none."""
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        value = marker.args[0] if marker.args else marker.kwargs.get("timeout")
        if value is not None:
            return float(value)
    option = item.config.getoption("timeout", None)
    if option is not None:
        return float(option)
    if os.environ.get("PYTEST_TIMEOUT"):
        return float(os.environ["PYTEST_TIMEOUT"])
    try:
        setting = item.config.getini("timeout")
    except ValueError:  # pytest-timeout is not installed
        return 0.0
    return float(setting or 0)


class Watchdog:
    """The pytest side: starts the watchdog process, arms it for each phase of each test."""

    def __init__(self) -> None:
        # Started now, while pytest captures nothing: the watchdog writes to the real stderr.
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tests.support.watchdog", str(os.getpid())],
            stdin=subprocess.PIPE,
            cwd=ROOT,
        )
        # The real stderr too: while a test runs, pytest's capture owns fd 2, and the process
        # ends before what it captured is shown.
        self._stderr: IO[str] = open(os.dup(2), "w")  # noqa: SIM115  (open for the whole run)
        self._debugging = False
        faulthandler.register(DUMP_SIGNAL, file=self._stderr, all_threads=True, chain=True)

    def _send(self, line: str) -> None:
        stdin = self._process.stdin
        assert stdin is not None
        try:
            stdin.write(line.encode() + b"\n")
            stdin.flush()
        except (BrokenPipeError, ValueError):
            pass  # the watchdog is gone: its end was already reported

    def _phase(self, item: pytest.Item, phase: str) -> Generator[None, Any, Any]:
        seconds = 0.0 if self._debugging else timeout_of(item)
        if seconds > 0:
            self._send(f"arm {seconds} {item.nodeid} ({phase})")
        try:
            return (yield)
        finally:
            if seconds > 0:
                self._send("disarm")

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, Any, Any]:
        return (yield from self._phase(item, "setup"))

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, Any, Any]:
        return (yield from self._phase(item, "call"))

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Generator[None, Any, Any]:
        return (yield from self._phase(item, "teardown"))

    def pytest_enter_pdb(self) -> None:
        # Someone is debugging (--pdb, breakpoint()): no timeout from now on, as pytest-timeout.
        self._debugging = True
        self._send("disarm")

    def pytest_report_header(self) -> str:
        return "timeouts: per phase, enforced by the watchdog (tests/support/watchdog.py)"

    @pytest.hookimpl(tryfirst=True)
    def pytest_timeout_set_timer(self) -> bool:
        return True  # handled: pytest-timeout starts no timer of its own

    @pytest.hookimpl(tryfirst=True)
    def pytest_timeout_cancel_timer(self) -> bool:
        return True

    def pytest_unconfigure(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        try:
            self._process.wait(GRACE)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        faulthandler.unregister(DUMP_SIGNAL)
        self._stderr.close()


def install(config: pytest.Config) -> None:
    """Register the watchdog for this run (once)."""
    if not config.pluginmanager.has_plugin("static-watchdog"):
        config.pluginmanager.register(Watchdog(), "static-watchdog")


# -- the watchdog process -------------------------------------------------------------------


def _say(text: str) -> None:
    sys.stderr.write(text)
    sys.stderr.flush()


def _state(pid: int) -> tuple[int, str] | None:
    """(parent pid, state letter) of ``pid``, or None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()
    return int(fields[1]), fields[0]


def _descendants(root: int) -> list[int]:
    """Every process below ``root`` now."""
    children: dict[int, list[int]] = {}
    try:
        entries = list(Path("/proc").iterdir())
    except OSError:  # no /proc (not Linux): the run's children are left to its process group
        entries = []
    for entry in entries:
        if entry.name.isdigit() and (state := _state(int(entry.name))) is not None:
            children.setdefault(state[0], []).append(int(entry.name))
    found: list[int] = []
    pending = [root]
    while pending:
        for child in children.get(pending.pop(), []):
            found.append(child)
            pending.append(child)
    return found


def _ended(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while True:
        state = _state(pid)
        if state is None or state[1] in "ZX":
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def _end_run(run: int, label: str, seconds: float) -> None:
    rule = "+" * 30
    _say(
        f"\n{rule} watchdog {rule}\n{label} still running after {seconds:g} s: ending the run"
        f" (pid {run}).\nIts native stacks (gdb) and every Python thread's stack"
        " (faulthandler, most recent call first) follow.\n"
    )
    others = [pid for pid in _descendants(run) if pid != os.getpid()]
    gdb = shutil.which("gdb")
    if gdb is not None:
        try:
            subprocess.run(
                [
                    gdb,
                    "-batch",
                    "-nx",
                    "-iex",
                    "set auto-load off",
                    "-p",
                    str(run),
                    "-ex",
                    "thread apply all bt",
                ],
                stdin=subprocess.DEVNULL,
                stdout=sys.stderr,
                stderr=subprocess.STDOUT,
                timeout=GDB_SECONDS,
                check=False,
            )
        except subprocess.TimeoutExpired:
            _say(f"watchdog: gdb took over {GDB_SECONDS:g} s\n")
    # Frozen while what it started stops (else a teardown waiting on one of its servers could
    # go on, and the run with it); they would outlive it otherwise: it never got to stop them.
    _signal(run, signal.SIGSTOP)
    for pid in others:
        _signal(pid, signal.SIGTERM)
    for pid in others:
        if not _ended(pid, GRACE):
            _signal(pid, signal.SIGKILL)
    _say(f"watchdog: stopped the {len(others)} processes the run started\n")
    _say(f"{rule} watchdog: Python stacks {rule}\n")
    # The dump is taken where the run stands: pending while it is stopped, the signal is
    # handled before any Python code runs again.
    _signal(run, DUMP_SIGNAL)
    _signal(run, signal.SIGCONT)
    if not _ended(run, GRACE):
        _signal(run, signal.SIGKILL)
        _ended(run, GRACE)


def main(run: int) -> None:
    # Ctrl-C is for the run; this process ends with it (its stdin closes).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    deadline: float | None = None
    label, seconds, pending = "", 0.0, b""
    while True:
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not select.select([0], [], [], wait)[0]:
            if deadline is not None and time.monotonic() >= deadline:
                _end_run(run, label, seconds)
                return
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            return
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            command, _, rest = line.decode(errors="replace").partition(" ")
            if command == "arm":
                text, _, label = rest.partition(" ")
                seconds = float(text)
                deadline = time.monotonic() + seconds
            elif command == "disarm":
                deadline = None


if __name__ == "__main__":
    main(int(sys.argv[1]))
