"""Storage: one interface (:class:`Database`), SQLite and PostgreSQL implementations, migrations.

``open_database(url)`` picks the backend from the URL (``sqlite:///path`` or
``postgresql://...``) and applies pending migrations before it yields; ``database_location(url)``
is what another client of the same database (the relay, which opens it itself) connects to.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from static.store._accounts import (
    AccountRecord,
    AccountStore,
    EmailTaken,
    KeyLimitReached,
    KeyOwner,
    KeyRecord,
    NewKey,
    SigningKeyRecord,
)
from static.store._database import Connection, Database, DatabaseError, IntegrityError, Row
from static.store._migrations import migrate

__all__ = [
    "AccountRecord",
    "AccountStore",
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
    "database_location",
    "open_database",
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

        async with open_sqlite(url[len(_SQLITE) :]) as sqlite_db:
            await migrate(sqlite_db)
            yield sqlite_db
    elif url.startswith(_POSTGRES):
        from static.store._postgres import open_postgres

        async with open_postgres(url) as pg_db:
            await migrate(pg_db)
            yield pg_db
    else:
        raise _unsupported(url)
