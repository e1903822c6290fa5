"""The storage interface: one small async SQL surface that both backends implement.

SQL is written once, in PostgreSQL's placeholder style (``$1``, ``$2``, ...); the SQLite backend
rewrites the placeholders to SQLite's numbered form (``?1``, ``?2``, ...), which binds the same
way. Rows support access by column name and by index on both backends.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

__all__ = ["Connection", "Database", "DatabaseError", "IntegrityError", "Row"]


class Row(Protocol):
    """A result row: ``row["column"]`` or ``row[0]``."""

    def __getitem__(self, key: str | int, /) -> Any: ...

    def keys(self) -> Any: ...


class DatabaseError(Exception):
    """A storage failure (connection lost, disk full, ...). Maps to a 503 or a gRPC UNAVAILABLE."""


class IntegrityError(DatabaseError):
    """A constraint was violated (unique key, foreign key, check)."""


class Connection(abc.ABC):
    """The statements of one transaction (or one auto-committed statement at a time)."""

    @abc.abstractmethod
    async def execute(self, sql: str, *args: Any) -> int:
        """Run a statement; return the number of rows it changed."""

    @abc.abstractmethod
    async def executemany(self, sql: str, args: Sequence[Sequence[Any]]) -> None:
        """Run one statement for each parameter tuple."""

    @abc.abstractmethod
    async def fetch(self, sql: str, *args: Any) -> list[Row]:
        """Run a query; return all rows."""

    @abc.abstractmethod
    async def fetchrow(self, sql: str, *args: Any) -> Row | None:
        """Run a query; return the first row or None."""

    @abc.abstractmethod
    async def execute_script(self, sql: str) -> None:
        """Run several ``;``-separated statements without parameters (migrations)."""

    async def fetchval(self, sql: str, *args: Any) -> Any:
        """Run a query; return the first column of the first row, or None."""
        row = await self.fetchrow(sql, *args)
        return None if row is None else row[0]


class Database(Connection):
    """A database: auto-committed statements, plus :meth:`transaction` for atomic groups.

    Statements on the database itself each run in their own implicit transaction. Use
    ``async with db.transaction() as tx:`` to make several statements atomic; the transaction
    commits when the block exits normally and rolls back when it raises (or is cancelled).
    """

    #: "sqlite" or "postgresql": for the few statements that must differ between backends.
    dialect: str

    @abc.abstractmethod
    def transaction(self) -> AbstractAsyncContextManager[Connection]:
        """Open a transaction (serialisable with respect to other writers)."""
