"""The server's data directory: created private, checked for others' access, and its SQLite
database held by one ``static serve`` at a time (an exclusive lock on a file beside it).

Two servers on one SQLite file used to both start; then every publish failed (``UNIQUE
constraint failed: relay_entries.channel_id, relay_entries.seq``: each relay numbers the log
from its own memory) and nothing was logged. PostgreSQL is exempt: its relays share the log by
design (docs/design.md §5.4).
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from static.store import database_location

__all__ = ["DatabaseInUse", "hold_database", "prepare_data_dir"]

_log = logging.getLogger("static.server")

#: What the lock file's name adds to the database's.
LOCK_SUFFIX = ".lock"


class DatabaseInUse(Exception):
    """Another process holds the SQLite database's lock (a configuration error)."""


def prepare_data_dir(data_dir: Path) -> None:
    """Create ``data_dir`` owner-only (0700) if missing; warn (not fatal) when an existing one
    can be read by group or others: it holds the JWT signing key (``static.db``)."""
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    _warn_if_shared(data_dir, "data directory", "chmod 700")


def _warn_if_shared(path: Path, what: str, fix: str) -> None:
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return
    if mode & 0o077:
        _log.warning(
            "the %s %s is open to group or others (mode %04o), and it holds the server's "
            "signing key and API key hashes: %s %s",
            what,
            path,
            mode,
            fix,
            path,
        )


@asynccontextmanager
async def hold_database(url: str) -> AsyncIterator[None]:
    """Hold the exclusive lock of the SQLite database at ``url`` (``<file>.lock``, 0600) for the
    ``with`` block; :class:`DatabaseInUse` if another process holds it. Nothing for
    PostgreSQL, which several servers share by design."""
    location = database_location(url)
    if location.startswith(("postgresql://", "postgres://")):
        yield
        return
    database = Path(location)
    database.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    _warn_if_shared(database, "database", "chmod 600")
    lock_path = database.with_name(database.name + LOCK_SUFFIX)
    # Non-blocking calls on a local file: no thread needed. flock, not fcntl/lockf: it belongs
    # to this open file, so a second server in this same process is refused too; the kernel
    # releases it when the process ends, however it ends.
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DatabaseInUse(
                f"the database {database} is in use by another static serve (it holds "
                f"{lock_path}): one server per SQLite database; servers that share a "
                "database need PostgreSQL"
            ) from None
        yield
    finally:
        os.close(fd)
