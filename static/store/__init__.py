"""Storage: one interface (:class:`Database`), SQLite and PostgreSQL implementations, migrations.

``open_database(url)`` picks the backend from the URL (``sqlite:///path`` or
``postgresql://...``) and applies pending migrations before it yields.
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
    "open_database",
    "sqlite_url",
]


def sqlite_url(path: str) -> str:
    """The database URL of the SQLite file at ``path``."""
    return f"sqlite:///{path}"


@asynccontextmanager
async def open_database(url: str) -> AsyncIterator[Database]:
    """Open the database at ``url``, migrate it, and yield it; close it on exit."""
    if url.startswith("sqlite:///"):
        from static.store._sqlite import open_sqlite

        async with open_sqlite(url[len("sqlite:///") :]) as sqlite_db:
            await migrate(sqlite_db)
            yield sqlite_db
    elif url.startswith(("postgresql://", "postgres://")):
        from static.store._postgres import open_postgres

        async with open_postgres(url) as pg_db:
            await migrate(pg_db)
            yield pg_db
    else:
        raise ValueError(
            f"unsupported database URL {url!r}: expected sqlite:///PATH or postgresql://..."
        )
