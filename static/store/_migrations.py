"""Schema migrations, applied at start on both backends.

Migrations are the files in ``static/store/migrations``: ``NNNN_name.sql`` for SQL both backends
accept, or a pair ``NNNN_name.sqlite.sql`` / ``NNNN_name.postgresql.sql`` where they differ. They
apply in version order, each in its own transaction, exactly once; a concurrent starter waits
(SQLite: the write lock; PostgreSQL: an advisory lock).

Each belongs to one part of the schema: the accounts' (the default) or the relay's (a first line
``-- database: relay``). On PostgreSQL both parts share one database. On SQLite the relay's part
is a file of its own (``static.store._split``): the relay reads and writes it with the SQLite
compiled into the extension, and this store uses Python's; two SQLite libraries on one file in
one process do not exclude each other (POSIX locks are per process), so they must never share one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from typing import Final

from static.store._database import Database

__all__ = ["ACCOUNTS", "RELAY", "Migration", "load_migrations", "migrate"]

#: The parts of the schema (see the module's docstring).
ACCOUNTS: Final = "accounts"
RELAY: Final = "relay"
_PART = re.compile(r"^-- database: (\w+)", re.MULTILINE)
_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+?)(?:\.(sqlite|postgresql))?\.sql$")
# Any constant works; it only has to be the same in every process that migrates this database.
_ADVISORY_LOCK = 0x5717_1C00


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    sql: str
    part: str


def load_migrations(dialect: str, part: str | None = None) -> list[Migration]:
    """The migrations for ``dialect`` (of one ``part`` of the schema, or all), in version order."""
    found: dict[int, Migration] = {}
    for entry in resources.files("static.store.migrations").iterdir():
        match = _FILE.match(entry.name)
        if match is None:
            continue
        version, name, only = int(match[1]), match[2], match[3]
        if only is not None and only != dialect:
            continue
        if version in found:
            raise RuntimeError(f"two migrations with version {version}: {entry.name}")
        sql = entry.read_text(encoding="utf-8")
        marked = _PART.search(sql)
        found[version] = Migration(version, name, sql, marked[1] if marked else ACCOUNTS)
    return [found[v] for v in sorted(found) if part is None or found[v].part == part]


async def migrate(db: Database, part: str | None = None) -> list[int]:
    """Apply the migrations (of one ``part`` of the schema, or all) ``db`` has not seen yet;
    return the versions applied."""
    await db.execute_script(
        "CREATE TABLE IF NOT EXISTS schema_migrations ("
        " version INTEGER PRIMARY KEY,"
        " name TEXT NOT NULL,"
        " applied_at TEXT NOT NULL)"
    )
    applied: list[int] = []
    for migration in load_migrations(db.dialect, part):
        async with db.transaction() as tx:
            if db.dialect == "postgresql":
                await tx.execute("SELECT pg_advisory_xact_lock($1)", _ADVISORY_LOCK)
            done = await tx.fetchval(
                "SELECT 1 FROM schema_migrations WHERE version = $1", migration.version
            )
            if done:
                continue
            await tx.execute_script(migration.sql)
            await tx.execute(
                "INSERT INTO schema_migrations (version, name, applied_at)"
                " VALUES ($1, $2, CURRENT_TIMESTAMP)",
                migration.version,
                migration.name,
            )
        applied.append(migration.version)
    return applied
