"""A hung test ends the run within its timeout, teardown included, with every thread's stack
printed and the servers it started stopped (issue 28, tests/support/watchdog.py): each test of
tests/support/hangs_on_purpose.py is run by a pytest of its own, with a short timeout."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.process import ROOT

#: The hung runs' timeout (seconds): above a server's start on a loaded machine (setup counts).
TIMEOUT = 8
#: Bound on a whole hung run: pytest's start, a server's, the timeout, gdb's native stacks and
#: the stop of what it started. Measured on a loaded 2-core machine: 18 to 23 s.
BOUND = 90


def _gone(pid: int, within: float) -> bool:
    """Whether ``pid`` has ended (or is a zombie nobody reaped yet) within ``within`` s."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return True
        if stat.rpartition(")")[2].split()[0] in "ZX":
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize(
    ("test", "frame", "workers"),
    [
        pytest.param(test, frame, [], id=f"{test}-{frame}")
        for test, frame in [
            ("test_fails_then_hangs_in_teardown", "server_then_sleep"),
            ("test_hangs_in_teardown_on_an_event", "wait_for_nothing"),
            ("test_hangs_in_teardown_holding_the_gil", "sleep_holding_the_gil"),
        ]
    ]
    # As scripts/test.sh runs the suite: in pytest-xdist's workers, each with its watchdog.
    + [
        pytest.param(
            "test_fails_then_hangs_in_teardown", "server_then_sleep", ["-n", "2"], id="xdist"
        )
    ],
)
def test_a_hang_in_teardown_ends_the_run(
    test: str, frame: str, workers: list[str], tmp_path: Path
) -> None:
    """Each ends within ``BOUND`` s, not ``FOREVER``. On 9b2be07 the first and the last hung
    (pytest-timeout's timer was cancelled by the failure; its thread could not take the GIL)
    and the second ended without naming the phase and left nothing to stop its children."""
    pids = tmp_path / "pids"
    started = time.monotonic()
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pytest",
            f"tests/support/hangs_on_purpose.py::{test}",
            "-o",
            f"timeout={TIMEOUT}",
            "-p",
            "no:cacheprovider",
            f"--basetemp={tmp_path / 'run'}",
            *workers,
        ],
        cwd=ROOT,
        env={**os.environ, "STATIC_HANG_PIDS": str(pids)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # Its own process group: should the backstop fail, this test still ends all of it.
        start_new_session=True,
    )
    try:
        output, _ = run.communicate(timeout=BOUND)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        output, _ = run.communicate()
        pytest.fail(f"the hung run was still going after {BOUND} s:\n{output}")
    elapsed = time.monotonic() - started

    assert run.returncode != 0, output
    assert elapsed >= TIMEOUT, output
    # Which test, which phase, after how long.
    expected = f"hangs_on_purpose.py::{test} (teardown) still running after {TIMEOUT} s"
    assert f"tests/support/{expected}" in output, output
    # Every Python thread's stack (faulthandler's), down to the hung finaliser.
    thread = r"^(Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):$"
    assert re.search(thread, output, re.M), output
    assert re.search(rf'File ".*hangs_on_purpose\.py", line \d+ in {frame}$', output, re.M), output
    assert "in pytest_runtest_teardown" in output, output
    if shutil.which("gdb") is not None:
        # The native stacks too: gdb's backtrace of the main thread.
        assert re.search(r"^#\d+ +(0x[0-9a-f]+ in )?\w", output, re.M), output
    if frame == "server_then_sleep":
        server = int(pids.read_text())
        assert _gone(server, 10), f"the server the hung test started (pid {server}) outlived it"
