"""A test's helper program in a subprocess (``python -m MODULE ARGS``), its stdout read line by
line with a deadline, killed or awaited at the end; and stopping a process for sure."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def stop_process(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and wait until every thread of it is stopped. The signal alone is not
    enough: until the thread chosen to take it is scheduled, the others run on, and on a loaded
    machine a stopped relay answered a request sent just after the signal (a test that needed
    the call to hang failed)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    tasks = Path(f"/proc/{pid}/task")
    while True:
        states = []
        for task in tasks.iterdir():
            try:
                # The state follows the command name in parentheses, which may hold spaces.
                states.append((task / "stat").read_text().rpartition(")")[2].split()[0])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue  # a thread that ended meanwhile
        if states and all(state in ("T", "t") for state in states):
            return
        assert time.monotonic() < deadline, f"process {pid} not stopped: {states}"
        time.sleep(0.005)


class LineProcess:
    """``python -m module *args`` from the repository's root, unbuffered; ``stdin`` piped when
    asked (the helper then waits for the test's go)."""

    def __init__(self, module: str, *args: str, stdin: bool = False) -> None:
        self.module = module
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdin=subprocess.PIPE if stdin else None,
            stdout=subprocess.PIPE,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert self.proc.stdout is not None
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.proc.stdout, selectors.EVENT_READ)
        self.buffer = b""

    def line(self, timeout: float) -> str:
        """The next line it prints; AssertionError when it prints none within ``timeout`` or
        ends first."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.module} said nothing within {timeout} s")
            if self.selector.select(0.1):
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    code = self.proc.wait(timeout)
                    raise AssertionError(f"{self.module} ended (exit {code})")
                self.buffer += chunk
        raw, self.buffer = self.buffer.split(b"\n", 1)
        return raw.decode()

    def end(self, *, kill: bool, timeout: float) -> int:
        """Kill it (SIGKILL) or let it end; its exit code. The pipes are closed."""
        if kill:
            self.proc.send_signal(signal.SIGKILL)
        code = self.proc.wait(timeout)
        self.selector.close()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()
        return code
