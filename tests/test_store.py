"""The storage interface on both backends: statements, transactions, errors, migrations."""

from __future__ import annotations

import pytest
import trio
import trio.lowlevel

from static.store import Database, IntegrityError, open_database
from static.store._migrations import load_migrations, migrate

SCHEMA = "CREATE TABLE IF NOT EXISTS t_items (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE)"


async def _db_with_table(db: Database) -> Database:
    await db.execute_script(SCHEMA)
    return db


async def test_statements_and_rows(database_url: str) -> None:
    async with open_database(database_url) as db:
        await _db_with_table(db)
        assert await db.execute("INSERT INTO t_items (id, name) VALUES ($1, $2)", 1, "a") == 1
        await db.executemany("INSERT INTO t_items (id, name) VALUES ($1, $2)", [(2, "b"), (3, "c")])
        row = await db.fetchrow("SELECT id, name FROM t_items WHERE name = $1", "b")
        assert row is not None
        assert (row["id"], row["name"], row[0]) == (2, "b", 2)
        rows = await db.fetch("SELECT name FROM t_items WHERE id >= $1 ORDER BY id DESC", 2)
        assert [r["name"] for r in rows] == ["c", "b"]
        assert await db.fetchval("SELECT count(*) FROM t_items") == 3
        assert await db.fetchrow("SELECT id FROM t_items WHERE id = $1", 99) is None
        assert await db.execute("UPDATE t_items SET name = name || $1", "!") == 3


async def test_unique_violation_is_integrity_error(database_url: str) -> None:
    async with open_database(database_url) as db:
        await _db_with_table(db)
        await db.execute("INSERT INTO t_items (id, name) VALUES ($1, $2)", 1, "a")
        with pytest.raises(IntegrityError):
            await db.execute("INSERT INTO t_items (id, name) VALUES ($1, $2)", 2, "a")


async def test_transaction_commits_or_rolls_back(database_url: str) -> None:
    async with open_database(database_url) as db:
        await _db_with_table(db)
        async with db.transaction() as tx:
            await tx.execute("INSERT INTO t_items (id, name) VALUES ($1, $2)", 1, "a")
        with pytest.raises(ZeroDivisionError):
            async with db.transaction() as tx:
                await tx.execute("INSERT INTO t_items (id, name) VALUES ($1, $2)", 2, "b")
                raise ZeroDivisionError
        with trio.move_on_after(0.05):
            async with db.transaction() as tx:
                await tx.execute("INSERT INTO t_items (id, name) VALUES ($1, $2)", 3, "c")
                await trio.sleep(10)
        assert [r["id"] for r in await db.fetch("SELECT id FROM t_items ORDER BY id")] == [1]
        # The database is still usable after the cancelled transaction.
        await db.execute("INSERT INTO t_items (id, name) VALUES ($1, $2)", 4, "d")


async def test_concurrent_transactions_serialise(database_url: str) -> None:
    async with open_database(database_url) as db:
        await db.execute_script(
            "CREATE TABLE t_counter (id INTEGER PRIMARY KEY, n INTEGER NOT NULL)"
        )
        await db.execute("INSERT INTO t_counter (id, n) VALUES (1, 0)")

        async def bump() -> None:
            async with db.transaction() as tx:
                if db.dialect == "postgresql":
                    n = await tx.fetchval("SELECT n FROM t_counter WHERE id = 1 FOR UPDATE")
                else:
                    n = await tx.fetchval("SELECT n FROM t_counter WHERE id = 1")
                await trio.lowlevel.checkpoint()
                await tx.execute("UPDATE t_counter SET n = $1 WHERE id = 1", n + 1)

        async with trio.open_nursery() as nursery:
            for _ in range(20):
                nursery.start_soon(bump)
        assert await db.fetchval("SELECT n FROM t_counter WHERE id = 1") == 20


async def test_migrations_apply_once(database_url: str, backend: str) -> None:
    expected = [m.version for m in load_migrations(backend)]
    async with open_database(database_url) as db:
        # open_database already migrated; a second run applies nothing.
        assert await migrate(db) == []
        versions = [r["version"] for r in await db.fetch("SELECT version FROM schema_migrations")]
        assert sorted(versions) == expected
