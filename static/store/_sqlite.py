"""SQLite backend: the stdlib ``sqlite3`` driven from threads.

One writer connection, owned by a long-lived thread of its own fed by a plain queue (serialised
by a lock on the trio side, transactions use ``BEGIN IMMEDIATE``), and a small pool of reader
connections used through trio's worker threads; WAL lets the readers run while the writer writes
(and the relay, which opens the same file with connections of its own). ``synchronous=FULL`` so
that a committed transaction survives a power cut, not only a process crash.
"""

from __future__ import annotations

import functools
import logging
import queue
import re
import sqlite3
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import outcome
import trio

from static import _metrics
from static.store._database import Connection, Database, DatabaseError, IntegrityError, Row

__all__ = ["SQLiteDatabase", "open_sqlite"]

_logger = logging.getLogger("static.store")
_T = TypeVar("_T")
#: Starts ``fn`` elsewhere and calls ``deliver`` with its outcome there (as
#: ``trio.lowlevel.start_thread_soon`` does).
_Spawn = Callable[[Callable[[], Any], Callable[[outcome.Outcome[Any]], None]], None]
_PLACEHOLDER = re.compile(r"\$(\d+)")
_READ_ONLY = re.compile(r"^\s*(SELECT|WITH)\b", re.IGNORECASE)
_READERS = 4


@functools.lru_cache(maxsize=512)
def _to_sqlite(sql: str) -> str:
    return _PLACEHOLDER.sub(r"?\1", sql)


def _split_script(script: str) -> list[str]:
    statements: list[str] = []
    buffer = ""
    for line in script.splitlines(keepends=True):
        buffer += line
        if sqlite3.complete_statement(buffer):
            if buffer.strip():
                statements.append(buffer.strip())
            buffer = ""
    if buffer.strip():
        statements.append(buffer.strip())
    return statements


def _connect(path: str) -> sqlite3.Connection:
    # isolation_level=None: autocommit; transactions are opened explicitly with BEGIN IMMEDIATE.
    conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=10.0)
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("PRAGMA foreign_keys=ON")
    conn.execute("PRAGMA busy_timeout=10000")
    return conn


async def _in_thread(
    fn: Callable[[sqlite3.Connection], _T],
    conn: sqlite3.Connection,
    spawn: _Spawn = trio.lowlevel.start_thread_soon,
) -> _T:
    """``trio.to_thread.run_sync(fn, conn)`` without its scheduling round before the thread
    starts (the capacity limiter's checkpoint: the calling task goes to the back of the run
    queue first). Threads are bounded here by the handles, one use of each at a time. Like
    ``run_sync``'s default, not abandoned on cancellation: a cancelled caller waits for the
    thread, and is not started when already cancelled."""
    await trio.lowlevel.checkpoint_if_cancelled()
    task = trio.lowlevel.current_task()
    token = trio.lowlevel.current_trio_token()

    def deliver(result: outcome.Outcome[_T]) -> None:
        token.run_sync_soon(trio.lowlevel.reschedule, task, result)

    spawn(functools.partial(fn, conn), deliver)

    def abort(_: Any) -> trio.lowlevel.Abort:
        return trio.lowlevel.Abort.FAILED

    result: _T = await trio.lowlevel.wait_task_rescheduled(abort)  # the outcome, unwrapped
    return result


class _WriterThread:
    """The thread that owns the writer connection: it runs, in order, what is put on its queue.

    A long-lived thread fed by a ``SimpleQueue`` rather than trio's worker threads: a write
    starts at once, with no trio scheduling round first, and always on the same thread."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="static-sqlite-writer", daemon=True)
        self._thread.start()

    def spawn(self, fn: Callable[[], Any], deliver: Callable[[outcome.Outcome[Any]], None]) -> None:
        self._jobs.put(lambda: deliver(outcome.capture(fn)))

    def stop(self) -> None:
        """Run what is queued, then end the thread (waits for it)."""
        self._jobs.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            _run_job(job)


def _run_job(job: Callable[[], None]) -> None:
    try:
        job()
    except Exception:  # a bug in a job: logged, the thread must go on
        _logger.exception("store: a writer job failed")


class _Handle:
    """One sqlite3 connection, one use at a time, each in a worker thread (``spawn``)."""

    def __init__(self, conn: sqlite3.Connection, spawn: _Spawn = trio.lowlevel.start_thread_soon):
        self.conn = conn
        self.lock = trio.Lock()
        self._spawn = spawn

    @asynccontextmanager
    async def locked(self) -> AsyncIterator[None]:
        """``async with self.lock``, without a scheduling round when the lock is free (trio's
        ``acquire`` always yields first: a write would wait behind every runnable task)."""
        try:
            self.lock.acquire_nowait()
        except trio.WouldBlock:
            await self.lock.acquire()
        try:
            yield
        finally:
            self.lock.release()

    async def run(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        try:
            return await _in_thread(fn, self.conn, self._spawn)
        except sqlite3.IntegrityError as exc:
            raise IntegrityError(str(exc)) from exc
        except sqlite3.Error as exc:
            raise DatabaseError(str(exc)) from exc


def _execute(sql: str, args: Sequence[Any]) -> Callable[[sqlite3.Connection], int]:
    def run(conn: sqlite3.Connection) -> int:
        return conn.execute(_to_sqlite(sql), tuple(args)).rowcount

    return run


def _fetch(sql: str, args: Sequence[Any]) -> Callable[[sqlite3.Connection], list[Row]]:
    def run(conn: sqlite3.Connection) -> list[Row]:
        return conn.execute(_to_sqlite(sql), tuple(args)).fetchall()

    return run


def _fetchrow(sql: str, args: Sequence[Any]) -> Callable[[sqlite3.Connection], Row | None]:
    def run(conn: sqlite3.Connection) -> Row | None:
        row: Row | None = conn.execute(_to_sqlite(sql), tuple(args)).fetchone()
        return row

    return run


def _executemany(sql: str, rows: Sequence[Sequence[Any]]) -> Callable[[sqlite3.Connection], None]:
    def run(conn: sqlite3.Connection) -> None:
        conn.executemany(_to_sqlite(sql), [tuple(r) for r in rows])

    return run


def _script(script: str) -> Callable[[sqlite3.Connection], None]:
    def run(conn: sqlite3.Connection) -> None:
        for statement in _split_script(script):
            conn.execute(statement)

    return run


class _TransactionConnection(Connection):
    """Statements inside a transaction, on the writer connection (whose lock the owner holds)."""

    def __init__(self, handle: _Handle) -> None:
        self._handle = handle

    async def execute(self, sql: str, *args: Any) -> int:
        return await self._handle.run(_execute(sql, args))

    async def executemany(self, sql: str, args: Sequence[Sequence[Any]]) -> None:
        await self._handle.run(_executemany(sql, args))

    async def fetch(self, sql: str, *args: Any) -> list[Row]:
        return await self._handle.run(_fetch(sql, args))

    async def fetchrow(self, sql: str, *args: Any) -> Row | None:
        return await self._handle.run(_fetchrow(sql, args))

    async def execute_script(self, sql: str) -> None:
        await self._handle.run(_script(sql))


class SQLiteDatabase(Database):
    """A SQLite database file, opened with :func:`open_sqlite`."""

    dialect = "sqlite"

    def __init__(self, writer: _WriterThread, readers: list[_Handle], path: str) -> None:
        #: The database file (``:memory:`` for a private in-memory database).
        self.path = path
        self._writer_thread = writer
        self._writer = _Handle(writer.conn, writer.spawn)
        self._readers = readers
        self._free_readers: trio.MemorySendChannel[_Handle]
        self._take_reader: trio.MemoryReceiveChannel[_Handle]
        self._free_readers, self._take_reader = trio.open_memory_channel(len(readers))
        for reader in readers:
            self._free_readers.send_nowait(reader)

    async def _read(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        reader = await self._take_reader.receive()
        try:
            return await reader.run(fn)
        finally:
            self._free_readers.send_nowait(reader)

    async def _write(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        async with self._writer.locked():
            return await self._writer.run(fn)

    async def execute(self, sql: str, *args: Any) -> int:
        return await self._write(_execute(sql, args))

    async def executemany(self, sql: str, args: Sequence[Sequence[Any]]) -> None:
        await self._write(_executemany(sql, args))

    async def fetch(self, sql: str, *args: Any) -> list[Row]:
        if _READ_ONLY.match(sql):
            return await self._read(_fetch(sql, args))
        return await self._write(_fetch(sql, args))

    async def fetchrow(self, sql: str, *args: Any) -> Row | None:
        if _READ_ONLY.match(sql):
            return await self._read(_fetchrow(sql, args))
        return await self._write(_fetchrow(sql, args))

    async def execute_script(self, sql: str) -> None:
        async with self.transaction() as tx:
            await tx.execute_script(sql)

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Connection]:
        async with self._writer.locked():
            with _metrics.store_commit():
                try:
                    await self._writer.run(_execute("BEGIN IMMEDIATE", ()))
                    try:
                        yield _TransactionConnection(self._writer)
                    except BaseException:
                        # Shielded: a cancelled caller must still leave the connection out
                        # of the transaction, or the next writer would find it open.
                        with trio.CancelScope(shield=True):
                            await self._writer.run(_execute("ROLLBACK", ()))
                        raise
                    with trio.CancelScope(shield=True):
                        await self._writer.run(_execute("COMMIT", ()))
                except DatabaseError as exc:
                    if not isinstance(exc, IntegrityError):
                        _metrics.store_failure()
                    raise

    def _close(self) -> None:
        self._writer_thread.stop()
        for handle in [self._writer, *self._readers]:
            handle.conn.close()


@asynccontextmanager
async def open_sqlite(path: str) -> AsyncIterator[SQLiteDatabase]:
    """Open (creating if needed) the SQLite database at ``path``."""
    if path != ":memory:":
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    try:
        writer = await trio.to_thread.run_sync(_connect, path)
        readers = [await trio.to_thread.run_sync(_connect, path) for _ in range(_READERS)]
    except sqlite3.Error as exc:
        raise DatabaseError(f"cannot open sqlite database {path!r}: {exc}") from exc
    db = SQLiteDatabase(_WriterThread(writer), [_Handle(r) for r in readers], path)
    try:
        yield db
    finally:
        db._close()
