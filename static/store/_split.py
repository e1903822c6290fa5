"""SQLite: where the relay's file is, and the upgrade that moves the relay's tables out of a file
shared with the accounts.

Why two files: the relay opens its SQLite database with the SQLite compiled into the native
extension, and this store with Python's. POSIX record locks belong to the process, not to the
library, so two SQLite libraries in one process do not exclude each other: measured here, the
relay committed a publish in 1 ms while Python's connection held the write lock of the same file
(as a second process it waits). Two writers then append to one WAL, and a library closing the
file drops the other's locks. Each file is therefore opened by one library only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
from pathlib import Path

from static.store._migrations import RELAY, load_migrations

__all__ = ["relay_path", "split_shared_file"]

_log = logging.getLogger("static.store")


def relay_path(path: str) -> str:
    """The relay's SQLite file beside the accounts' file ``path`` (``static.db`` ->
    ``static-relay.db``)."""
    file = Path(path)
    return str(file.with_name(f"{file.stem}-relay{file.suffix}"))


def _tables(conn: sqlite3.Connection) -> list[str]:
    rows = conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite\\_%' "
        "ESCAPE '\\'"
    )
    return [row[0] for row in rows]


def _is_relay(table: str) -> bool:
    return table.startswith("relay_")


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _fsync(path: str | Path, *, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _keep_only(conn: sqlite3.Connection, keep_relay: bool, relay_versions: list[int]) -> None:
    """Drops one part's tables and migration records from ``conn``'s database."""
    marks = ",".join("?" * len(relay_versions)) or "NULL"
    conn.execute("BEGIN IMMEDIATE")
    for table in _tables(conn):
        if table != "schema_migrations" and _is_relay(table) != keep_relay:
            conn.execute(f"DROP TABLE {_quoted(table)}")
    conn.execute(
        f"DELETE FROM schema_migrations WHERE version {'NOT IN' if keep_relay else 'IN'} ({marks})",
        relay_versions,
    )
    conn.execute("COMMIT")


def split_shared_file(path: str) -> bool:
    """Moves the relay's tables out of the accounts' SQLite file ``path`` into
    :func:`relay_path` (a database made by a release that kept both in one file); returns whether
    there was anything to move. Call it before either file is opened by anyone else.

    Crash-safe: the relay's file appears (renamed into place, synced) only once complete, and
    the accounts' file loses the relay's tables only after that; a crash in between is finished
    by the next start.
    """
    if not os.path.exists(path):
        return False
    relay_versions = [m.version for m in load_migrations("sqlite", RELAY)]
    target = relay_path(path)
    src = sqlite3.connect(path, isolation_level=None)
    try:
        if not any(_is_relay(table) for table in _tables(src)):
            return False
        if not os.path.exists(target):
            _log.info("moving the relay's tables from %s to %s (once)", path, target)
            partial = target + ".partial"
            for leftover in (partial, partial + "-wal", partial + "-shm", partial + "-journal"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(leftover)
            dst = sqlite3.connect(partial, isolation_level=None)
            try:
                src.backup(dst)
                # The accounts' tables hold the signing keys: their pages are zeroed, not only
                # freed, in the relay's copy.
                dst.execute("PRAGMA secure_delete=ON")
                _keep_only(dst, keep_relay=True, relay_versions=relay_versions)
                dst.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            finally:
                dst.close()
            _fsync(partial)
            os.replace(partial, target)
            _fsync(Path(target).parent, directory=True)
        _keep_only(src, keep_relay=False, relay_versions=relay_versions)
        # What the log took is given back (VACUUM rewrites only what is left: the accounts).
        src.execute("VACUUM")
        return True
    finally:
        src.close()
