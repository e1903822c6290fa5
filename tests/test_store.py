"""The storage interface on both backends: statements, transactions, errors, migrations."""

from __future__ import annotations

import contextlib
import re
import sqlite3
from pathlib import Path

import pytest
import trio
import trio.lowlevel

from static.store import Database, IntegrityError, open_database, relay_database, sqlite_url
from static.store._migrations import ACCOUNTS, RELAY, load_migrations, migrate
from static.store._split import relay_path, split_shared_file
from static.store._sqlite import open_sqlite

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


async def _versions(db: Database) -> list[int]:
    return sorted(r["version"] for r in await db.fetch("SELECT version FROM schema_migrations"))


async def test_migrations_apply_once(database_url: str, backend: str) -> None:
    # On SQLite the relay's part is a file of its own; on PostgreSQL one database has both.
    part = ACCOUNTS if backend == "sqlite" else None
    async with open_database(database_url) as db:
        # open_database already migrated; a second run applies nothing.
        assert await migrate(db, part) == []
        assert await _versions(db) == [m.version for m in load_migrations(backend, part)]
    if backend == "sqlite":
        async with open_sqlite(relay_database(database_url)) as relay:
            assert await migrate(relay, RELAY) == []
            assert await _versions(relay) == [m.version for m in load_migrations(backend, RELAY)]


def _tables(path: str) -> set[str]:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        rows = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
    # sqlite_sequence is SQLite's own (AUTOINCREMENT's counters: audit_events, relay_audit).
    return {name for (name,) in rows if not name.startswith("sqlite_")} - {"schema_migrations"}


def test_every_migration_belongs_to_one_part() -> None:
    for dialect in ("sqlite", "postgresql"):
        every = load_migrations(dialect)
        parts = load_migrations(dialect, ACCOUNTS) + load_migrations(dialect, RELAY)
        assert sorted(m.version for m in parts) == [m.version for m in every]
        for migration in load_migrations(dialect, RELAY):
            # What the relay's file may hold: its own tables only.
            created = re.findall(r"CREATE TABLE (\w+)", migration.sql)
            assert all(name.startswith("relay_") for name in created), migration.name


async def test_sqlite_keeps_the_relays_tables_in_a_file_of_their_own(tmp_path: Path) -> None:
    url = sqlite_url(str(tmp_path / "static.db"))
    async with open_database(url):
        pass
    accounts, relay = _tables(str(tmp_path / "static.db")), _tables(relay_database(url))
    assert relay and all(name.startswith("relay_") for name in relay)
    assert "accounts" in accounts and not any(name.startswith("relay_") for name in accounts)


#: A private key's bytes, to look for in the relay's file after the split.
_SECRET = b"signing-key-bytes-" + b"\x5a" * 46


def _shared_file(path: Path) -> None:
    """A database as releases before the split made it: both parts in one file, with rows."""
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(
            "CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, name TEXT NOT NULL,"
            " applied_at TEXT NOT NULL)"
        )
        for m in load_migrations("sqlite"):
            conn.executescript(m.sql)
            conn.execute(
                "INSERT INTO schema_migrations VALUES (?, ?, CURRENT_TIMESTAMP)",
                (m.version, m.name),
            )
        conn.execute(
            "INSERT INTO signing_keys (kid, algorithm, private_key, created_at)"
            " VALUES ('k1', 'EdDSA', ?, CURRENT_TIMESTAMP)",
            (_SECRET,),
        )
        conn.execute(
            "INSERT INTO relay_channels (id, scope, name, head_seq, epoch)"
            " VALUES (7, '', 'a/b/c', 0, 0)"
        )


async def test_a_file_shared_by_an_earlier_release_is_split_once(tmp_path: Path) -> None:
    path = tmp_path / "static.db"
    _shared_file(path)
    url = sqlite_url(str(path))
    async with open_database(url) as db:
        assert await db.fetchval("SELECT kid FROM signing_keys") == "k1"
    relay = relay_database(url)
    assert _tables(relay) and all(name.startswith("relay_") for name in _tables(relay))
    assert not any(name.startswith("relay_") for name in _tables(str(path)))
    with contextlib.closing(sqlite3.connect(relay)) as conn:
        assert conn.execute("SELECT name FROM relay_channels WHERE id = 7").fetchone() == ("a/b/c",)
        versions = [v for (v,) in conn.execute("SELECT version FROM schema_migrations")]
    assert sorted(versions) == [m.version for m in load_migrations("sqlite", RELAY)]
    # The signing key's pages were zeroed in the relay's copy, not only freed.
    assert _SECRET not in _contents(relay)
    assert not _contents(relay + ".partial")
    assert split_shared_file(str(path)) is False  # once


def _contents(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        return b""


def _interrupted_split(tmp_path: Path) -> Path:
    """A shared file whose relay's file is complete (it appears only so) but which still has the
    relay's tables; and a copy left half-made by a crash before that."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    _shared_file(elsewhere / "static.db")
    assert split_shared_file(str(elsewhere / "static.db"))
    path = tmp_path / "static.db"
    _shared_file(path)
    Path(relay_path(str(elsewhere / "static.db"))).rename(relay_path(str(path)))
    with contextlib.closing(sqlite3.connect(relay_path(str(path)), isolation_level=None)) as conn:
        conn.execute("UPDATE relay_channels SET name = 'kept/in/relay' WHERE id = 7")
    Path(relay_path(str(path)) + ".partial").write_bytes(b"half a copy")
    return path


async def test_a_split_interrupted_after_the_relays_file_appeared_is_finished(
    tmp_path: Path,
) -> None:
    # The relay's file is kept, the shared one loses the relay's tables, the half copy is ignored.
    path = _interrupted_split(tmp_path)
    async with open_database(sqlite_url(str(path))):
        pass
    assert not any(name.startswith("relay_") for name in _tables(str(path)))
    with contextlib.closing(sqlite3.connect(relay_path(str(path)))) as conn:
        assert conn.execute("SELECT name FROM relay_channels").fetchall() == [("kept/in/relay",)]
