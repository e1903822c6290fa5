"""Reads an open SDK database from another process: never from the test's own.

The SDK links its own copy of SQLite (bundled in the native extension), and Python's ``sqlite3``
is a second copy. Two copies in one process break each other's POSIX locks: closing one copy's
file descriptor drops the other's locks on the file (sqlite.org/howtocorrupt.html, 2.2.1).
Measured here: a test that polled the outbox with ``sqlite3`` while the SDK wrote it died of
SIGBUS 4 times in 40 runs (the WAL's shared memory truncated under the SDK's mapping), and saw
nothing written in 20 s once more.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_POLL = """
import sqlite3, sys, time
path, sql, within = sys.argv[1], sys.argv[2], float(sys.argv[3])
deadline = time.monotonic() + within
with sqlite3.connect(path) as db:
    while True:
        (value,) = db.execute(sql).fetchone()
        if value or time.monotonic() >= deadline:
            print(value)
            break
        time.sleep(0.02)
"""

_RUN = """
import sqlite3, sys
with sqlite3.connect(sys.argv[1], isolation_level=None) as db:
    db.execute(sys.argv[2], sys.argv[3:])
"""


def poll_value(db: Path, sql: str, within: float) -> int:
    """The integer ``sql`` (one row, one column) gives, once it is nonzero, or 0 after
    ``within`` seconds."""
    done = subprocess.run(
        [sys.executable, "-c", _POLL, str(db), sql, str(within)],
        capture_output=True,
        text=True,
        timeout=within + 60,
        check=True,
    )
    return int(done.stdout)


def execute(db: Path, sql: str, *params: str) -> None:
    """Runs one statement (e.g. ``VACUUM INTO ?``) on ``db``, with text parameters."""
    subprocess.run(
        [sys.executable, "-c", _RUN, str(db), sql, *params],
        capture_output=True,
        timeout=120,
        check=True,
    )
