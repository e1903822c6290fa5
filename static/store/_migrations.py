"""Schema migrations, applied at start on both backends.

Migrations are the files in ``static/store/migrations``: ``NNNN_name.sql`` for SQL both backends
accept, or a pair ``NNNN_name.sqlite.sql`` / ``NNNN_name.postgresql.sql`` where they differ. They
apply in version order, each in its own transaction, exactly once; a concurrent starter waits
(SQLite: the write lock; PostgreSQL: an advisory lock).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources

from static.store._database import Database

__all__ = ["Migration", "load_migrations", "migrate"]

_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+?)(?:\.(sqlite|postgresql))?\.sql$")
# Any constant works; it only has to be the same in every process that migrates this database.
_ADVISORY_LOCK = 0x5717_1C00


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    sql: str


def load_migrations(dialect: str) -> list[Migration]:
    """The migrations for ``dialect``, in version order."""
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
        found[version] = Migration(version, name, entry.read_text(encoding="utf-8"))
    return [found[v] for v in sorted(found)]


async def migrate(db: Database) -> list[int]:
    """Apply the migrations ``db`` has not seen yet; return the versions applied."""
    await db.execute_script(
        "CREATE TABLE IF NOT EXISTS schema_migrations ("
        " version INTEGER PRIMARY KEY,"
        " name TEXT NOT NULL,"
        " applied_at TEXT NOT NULL)"
    )
    applied: list[int] = []
    for migration in load_migrations(db.dialect):
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
