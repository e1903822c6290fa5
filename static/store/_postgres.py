"""PostgreSQL backend: asyncpg through triopg, inside a trio-asyncio loop.

Every trio<->asyncio crossing costs client CPU (~150 µs, docs/design.md §7), and triopg's own
pool crosses three times per query (acquire, query, release). So the pool lives on the trio side:
idle triopg connections wait in a list guarded by a trio semaphore, and a query is one crossing.
Callers still keep statements per request low (one per authenticated request is the target).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import asyncpg
import trio
import trio_asyncio
import triopg

from static import _metrics
from static.store._database import Connection, Database, DatabaseError, IntegrityError, Row

__all__ = ["PostgresDatabase", "open_postgres"]

_T = TypeVar("_T")
#: Errors that mean the connection (not the statement) is broken.
_CONNECTION_ERRORS = (asyncpg.InterfaceError, asyncpg.PostgresConnectionError, OSError)


async def _guard(call: Awaitable[_T]) -> _T:
    try:
        return await call
    except asyncpg.IntegrityConstraintViolationError as exc:
        raise IntegrityError(str(exc)) from exc
    except (asyncpg.PostgresError, *_CONNECTION_ERRORS) as exc:
        raise DatabaseError(str(exc)) from exc


class _Statements(Connection):
    """Statements on one triopg connection: each is one trio<->asyncio crossing."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    async def execute(self, sql: str, *args: Any) -> int:
        status: str = await _guard(self._conn.execute(sql, *args))
        # asyncpg returns the command tag, e.g. "UPDATE 3" or "INSERT 0 1".
        last = status.rsplit(" ", 1)[-1]
        return int(last) if last.isdigit() else 0

    async def executemany(self, sql: str, args: Sequence[Sequence[Any]]) -> None:
        await _guard(self._conn.executemany(sql, [tuple(a) for a in args]))

    async def fetch(self, sql: str, *args: Any) -> list[Row]:
        rows: list[Row] = await _guard(self._conn.fetch(sql, *args))
        return rows

    async def fetchrow(self, sql: str, *args: Any) -> Row | None:
        row: Row | None = await _guard(self._conn.fetchrow(sql, *args))
        return row

    async def execute_script(self, sql: str) -> None:
        # Without arguments asyncpg runs a multi-statement script in one round trip.
        await _guard(self._conn.execute(sql))


class _Pool:
    """Up to ``max_size`` triopg connections, opened on demand and reused."""

    def __init__(self, dsn: str, max_size: int) -> None:
        self._dsn = dsn
        self._slots = trio.Semaphore(max_size)
        self._idle: list[Any] = []
        self._closed = False

    async def _connect(self) -> Any:
        conn = triopg.connect(self._dsn)
        try:
            await conn.__aenter__()
        except (asyncpg.PostgresError, *_CONNECTION_ERRORS) as exc:
            raise DatabaseError(f"cannot connect to PostgreSQL: {exc}") from exc
        return conn

    @staticmethod
    async def _discard(conn: Any) -> None:
        with trio.CancelScope(shield=True):
            try:
                await conn.close()
            except (asyncpg.PostgresError, *_CONNECTION_ERRORS):
                pass  # Already broken: closing is best effort.

    @asynccontextmanager
    async def acquire(self) -> AsyncIterator[Any]:
        async with self._slots:
            if self._closed:
                raise DatabaseError("the database is closed")
            conn = self._idle.pop() if self._idle else await self._connect()
            reusable = False
            try:
                yield conn
                reusable = True
            except DatabaseError as exc:
                # A statement the server refused leaves the connection usable; a broken
                # connection does not.
                reusable = not isinstance(exc.__cause__, _CONNECTION_ERRORS)
                raise
            finally:
                # A cancelled query may leave asyncpg mid-protocol: such a connection is dropped.
                if reusable and not self._closed and not conn.is_closed():
                    self._idle.append(conn)
                else:
                    await self._discard(conn)

    async def close(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            await self._discard(conn)


class PostgresDatabase(Database):
    """A PostgreSQL database, opened with :func:`open_postgres`."""

    dialect = "postgresql"

    def __init__(self, pool: _Pool) -> None:
        self._pool = pool

    async def execute(self, sql: str, *args: Any) -> int:
        async with self._pool.acquire() as conn:
            return await _Statements(conn).execute(sql, *args)

    async def executemany(self, sql: str, args: Sequence[Sequence[Any]]) -> None:
        async with self._pool.acquire() as conn:
            await _Statements(conn).executemany(sql, args)

    async def fetch(self, sql: str, *args: Any) -> list[Row]:
        async with self._pool.acquire() as conn:
            return await _Statements(conn).fetch(sql, *args)

    async def fetchrow(self, sql: str, *args: Any) -> Row | None:
        async with self._pool.acquire() as conn:
            return await _Statements(conn).fetchrow(sql, *args)

    async def execute_script(self, sql: str) -> None:
        async with self.transaction() as tx:
            await tx.execute_script(sql)

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Connection]:
        with _metrics.store_commit():
            async with self._pool.acquire() as conn:
                try:
                    async with conn.transaction():
                        yield _Statements(conn)
                except asyncpg.IntegrityConstraintViolationError as exc:
                    raise IntegrityError(str(exc)) from exc
                except (asyncpg.PostgresError, *_CONNECTION_ERRORS) as exc:
                    _metrics.store_failure()
                    raise DatabaseError(str(exc)) from exc


@asynccontextmanager
async def open_postgres(dsn: str, *, max_connections: int = 32) -> AsyncIterator[PostgresDatabase]:
    """Connect to the PostgreSQL server at ``dsn`` (a ``postgresql://`` URL)."""
    async with trio_asyncio.open_loop():
        pool = _Pool(dsn, max_connections)
        try:
            # Connect once now so a wrong URL fails at start, not at the first request.
            async with pool.acquire():
                pass
            yield PostgresDatabase(pool)
        finally:
            await pool.close()
