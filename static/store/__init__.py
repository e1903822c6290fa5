"""Storage: one interface (:class:`Database`), SQLite and PostgreSQL implementations, migrations.

``open_database(url)`` picks the backend from the URL (``sqlite:///path`` or
``postgresql://...``) and applies pending migrations before it yields; ``relay_database(url)``
is what the relay, which opens its part of the database itself, connects to (on SQLite, a file
of its own).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from static.store._accounts import (
    ALL_SCOPES,
    AccountRecord,
    AccountStore,
    EmailTaken,
    KeyLimitReached,
    KeyOwner,
    KeyRecord,
    NewKey,
    SigningKeyRecord,
    SweptKeys,
)
from static.store._audit import AUDIT_CURSOR_PATTERN, AuditPage, AuditStore, parse_audit_cursor
from static.store._database import Connection, Database, DatabaseError, IntegrityError, Row
from static.store._migrations import ACCOUNTS, RELAY, migrate
from static.store._split import relay_path, split_shared_file

__all__ = [
    "ALL_SCOPES",
    "AUDIT_CURSOR_PATTERN",
    "AccountRecord",
    "AccountStore",
    "AuditPage",
    "AuditStore",
    "Connection",
    "Database",
    "DatabaseError",
    "EmailTaken",
    "IntegrityError",
    "KeyLimitReached",
    "KeyOwner",
    "KeyRecord",
    "NewKey",
    "Row",
    "SigningKeyRecord",
    "SweptKeys",
    "database_location",
    "open_database",
    "parse_audit_cursor",
    "relay_database",
    "sqlite_url",
]


def sqlite_url(path: str) -> str:
    """The database URL of the SQLite file at ``path``."""
    return f"sqlite:///{path}"


_SQLITE = "sqlite:///"
_POSTGRES = ("postgresql://", "postgres://")


def _unsupported(url: str) -> ValueError:
    return ValueError(
        f"unsupported database URL {url!r}: expected sqlite:///PATH or postgresql://..."
    )


def relay_database(url: str) -> str:
    """What the relay opens for the database at ``url``: the PostgreSQL URL as given, or, on
    SQLite, the relay's own file beside the accounts' (``static.store._split``). ``ValueError``
    as :func:`database_location`."""
    location = database_location(url)
    return location if url.startswith(_POSTGRES) else relay_path(location)


def database_location(url: str) -> str:
    """Where the database at ``url`` is for another client of it (the relay opens the database
    itself, beside this store): the SQLite file's path, or the PostgreSQL URL as given.

    ``ValueError`` for an unsupported URL, and for a SQLite database that no second connection
    can share: in memory (``sqlite:///:memory:``), temporary (``sqlite:///``, an empty path), or
    a URI filename (``file:...``: the relay opens SQLite paths as URIs, this store as file names,
    so the two would not open the same database).
    """
    if url.startswith(_POSTGRES):
        return url
    if not url.startswith(_SQLITE):
        raise _unsupported(url)
    path = url[len(_SQLITE) :]
    if path in ("", ":memory:") or path.startswith("file:"):
        raise ValueError(
            f"database {url!r} cannot be shared: the relay opens the database itself, beside "
            "the HTTP API, and would not find this one (a SQLite database in memory, temporary "
            "or named by a URI); use a file (sqlite:///PATH) or PostgreSQL"
        )
    return path


@asynccontextmanager
async def open_database(url: str) -> AsyncIterator[Database]:
    """Open the database at ``url``, migrate it, and yield it; close it on exit."""
    if url.startswith(_SQLITE):
        from static.store._sqlite import open_sqlite

        path = url[len(_SQLITE) :]
        if path not in ("", ":memory:") and not path.startswith("file:"):
            # The relay's part of the schema, in its own file, made and migrated before the
            # relay (or anyone) opens it; and moved there first from a file that held both.
            await trio.to_thread.run_sync(split_shared_file, path)
            async with open_sqlite(relay_path(path)) as relay_db:
                await migrate(relay_db, RELAY)
        async with open_sqlite(path) as sqlite_db:
            await migrate(sqlite_db, ACCOUNTS)
            yield sqlite_db
    elif url.startswith(_POSTGRES):
        from static.store._postgres import open_postgres

        async with open_postgres(url) as pg_db:
            await migrate(pg_db)
            yield pg_db
    else:
        raise _unsupported(url)
