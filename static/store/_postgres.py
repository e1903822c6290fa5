"""PostgreSQL backend: asyncpg through triopg, inside a trio-asyncio loop.

triopg pays one trio<->asyncio crossing per call, so callers keep the number of statements per
request low (one per authenticated request is the target; see DESIGN §7).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import asyncpg
import trio
import trio_asyncio
import triopg

from static.store._database import Connection, Database, DatabaseError, IntegrityError, Row

__all__ = ["PostgresDatabase", "open_postgres"]

_T = TypeVar("_T")


async def _guard(call: Awaitable[_T]) -> _T:
    try:
        return await call
    except asyncpg.IntegrityConstraintViolationError as exc:
        raise IntegrityError(str(exc)) from exc
    except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as exc:
        raise DatabaseError(str(exc)) from exc


class _PoolOrConnection(Connection):
    def __init__(self, target: Any) -> None:
        self._target = target

    async def execute(self, sql: str, *args: Any) -> int:
        status: str = await _guard(self._target.execute(sql, *args))
        # asyncpg returns the command tag, e.g. "UPDATE 3" or "INSERT 0 1".
        last = status.rsplit(" ", 1)[-1]
        return int(last) if last.isdigit() else 0

    async def executemany(self, sql: str, args: Sequence[Sequence[Any]]) -> None:
        await _guard(self._target.executemany(sql, [tuple(a) for a in args]))

    async def fetch(self, sql: str, *args: Any) -> list[Row]:
        rows: list[Row] = await _guard(self._target.fetch(sql, *args))
        return rows

    async def fetchrow(self, sql: str, *args: Any) -> Row | None:
        row: Row | None = await _guard(self._target.fetchrow(sql, *args))
        return row

    async def execute_script(self, sql: str) -> None:
        # Without arguments asyncpg runs a multi-statement script in one round trip.
        await _guard(self._target.execute(sql))


class PostgresDatabase(_PoolOrConnection, Database):
    """A PostgreSQL database, opened with :func:`open_postgres`."""

    dialect = "postgresql"

    def __init__(self, pool: Any) -> None:
        super().__init__(pool)
        self._pool = pool

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Connection]:
        acquire: Callable[[], Any] = self._pool.acquire
        try:
            async with acquire() as conn, conn.transaction():
                yield _PoolOrConnection(conn)
        except asyncpg.IntegrityConstraintViolationError as exc:
            raise IntegrityError(str(exc)) from exc
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as exc:
            raise DatabaseError(str(exc)) from exc

    async def execute_script(self, sql: str) -> None:
        async with self.transaction() as tx:
            await tx.execute_script(sql)


@asynccontextmanager
async def open_postgres(dsn: str, *, max_connections: int = 10) -> AsyncIterator[PostgresDatabase]:
    """Connect a pool to the PostgreSQL server at ``dsn`` (a ``postgresql://`` URL)."""
    async with trio_asyncio.open_loop():
        try:
            pool = triopg.create_pool(dsn, min_size=1, max_size=max_connections)
            await pool.__aenter__()
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as exc:
            raise DatabaseError(f"cannot connect to PostgreSQL: {exc}") from exc
        try:
            yield PostgresDatabase(pool)
        finally:
            with trio.CancelScope(shield=True):
                await pool.close()
