"""The audit log: reads an account's events from both sources, newest first, and prunes them.

Two tables hold events: ``audit_events`` (the accounts' part, migration 0011: key changes, written
by :class:`~static.store.AccountStore` in the change's transaction) and ``relay_audit`` (the
relay's part, 0012: channel and membership changes, written by the Rust relay). On PostgreSQL
both are in the one database. On SQLite ``relay_audit`` is in the relay's file
(``static.store._split``), which this store only reads, through one read-only connection kept
open for the process's life (closing a file drops the POSIX locks every library of the process
holds on it, ``_split``'s docstring: so never per request), and never writes. What remains of
the two-libraries hazard falls on this reader alone: the relay's SQLite cannot see its read
lock (same process), so a checkpoint that restarts the WAL under a read may make that one read
fail (a 503) or see a torn page; the relay's own data is never at stake (nothing is written,
and a read-only connection does not checkpoint on close). A relay call that reads its own table
would remove even that. Pruning the relay's table on SQLite is the relay's own job; reads hide
what is past the retention anyway, so both backends answer alike.

Order: ``(at_ms, source, seq)`` descending, source ``r`` before ``k`` at the same ms. A cursor is
the key of the last event returned; each source is read past it with one indexed query.
"""

from __future__ import annotations

import json
import logging
import re
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from static._time import iso_utc_ms
from static.store._database import Database, DatabaseError
from static.store._split import relay_path

__all__ = ["AUDIT_CURSOR_PATTERN", "AuditPage", "AuditStore", "parse_audit_cursor"]

_log = logging.getLogger("static.store")

#: A cursor as GET /v1/audit hands it out: ``<at_ms>.<k|r><seq>`` (opaque to clients; stated in
#: the OpenAPI document so that any text of this form is a valid cursor).
AUDIT_CURSOR_PATTERN = r"^[0-9]{1,15}\.[kr][0-9]{1,18}$"
_CURSOR = re.compile(AUDIT_CURSOR_PATTERN[1:-1])
#: Rows deleted per statement when pruning (short transactions; the loop takes the rest).
_PRUNE_BATCH = 1000
# Rank of each source at the same ms (higher comes first when newest first).
_RANK = {"k": 0, "r": 1}
_NO_SEQ = 2**63 - 1


@dataclass(frozen=True, slots=True)
class AuditPage:
    events: list[dict[str, Any]]
    next_cursor: str | None


def parse_audit_cursor(text: str) -> tuple[int, str, int] | None:
    """The position a cursor names, or None if ``text`` is not one."""
    if _CURSOR.fullmatch(text) is None:
        return None
    at, _, rest = text.partition(".")
    return int(at), rest[0], int(rest[1:])


def _detail(text: Any) -> dict[str, Any]:
    # The relay's rows come from another program: a detail that is not a JSON object is left
    # out rather than failing the page.
    try:
        value = json.loads(text)
    except (TypeError, ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


class _ReadOnlyFile:
    """One read-only connection to a SQLite file, opened on first use, used one call at a time
    from a worker thread; never closed before the process ends (see the module docstring)."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._conn: sqlite3.Connection | None = None
        self._lock = trio.Lock()
        self._thread_lock = threading.Lock()

    def _open(self) -> sqlite3.Connection:
        if self._conn is None:
            uri = "file:" + self._path.replace("?", "%3f").replace("#", "%23") + "?mode=ro"
            conn = sqlite3.connect(uri, uri=True, check_same_thread=False, isolation_level=None)
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA busy_timeout=10000")
            self._conn = conn
        return self._conn

    async def fetch(self, sql: str, *args: Any) -> list[Any]:
        def run() -> list[Any]:
            with self._thread_lock:
                return self._open().execute(re.sub(r"\$(\d+)", r"?\1", sql), args).fetchall()

        async with self._lock:
            try:
                return await trio.to_thread.run_sync(run)
            except sqlite3.Error as exc:
                raise DatabaseError(str(exc)) from exc


class AuditStore:
    """GET /v1/audit's reads, and the retention's prune, over the accounts' database ``db``."""

    def __init__(self, db: Database) -> None:
        self._db = db
        self._relay: Database | _ReadOnlyFile = db
        path = getattr(db, "path", None)
        if db.dialect == "sqlite" and isinstance(path, str) and path != ":memory:":
            self._relay = _ReadOnlyFile(relay_path(path))
        # A SQLite database without a relay file (in memory): no relay events to show.
        self._has_relay = db.dialect != "sqlite" or isinstance(self._relay, _ReadOnlyFile)

    async def page(
        self,
        account_id: str,
        *,
        limit: int,
        cursor: tuple[int, str, int] | None,
        since_ms: int,
    ) -> AuditPage:
        """Up to ``limit`` events of ``account_id`` after ``cursor``, newest first, none older
        than ``since_ms``."""
        rows: list[tuple[int, str, int, dict[str, Any]]] = []
        sources: list[tuple[str, Callable[..., Any], str]] = [
            ("k", self._db.fetch, "SELECT seq, at_ms, type, key_id, detail FROM audit_events"),
        ]
        if self._has_relay:
            sources.append(
                (
                    "r",
                    self._relay.fetch,
                    "SELECT seq, at_ms, type, key_id, detail, channel FROM relay_audit",
                )
            )
        more = False
        for source, fetch, select in sources:
            at, seq = _NO_SEQ, _NO_SEQ
            if cursor is not None:
                at = cursor[0]
                if _RANK[source] == _RANK[cursor[1]]:
                    seq = cursor[2]
                elif _RANK[source] > _RANK[cursor[1]]:
                    seq = 0  # this source's rows at that ms came before the cursor
            found = await _missing_table_is_empty(
                fetch(
                    select + " WHERE account = $1 AND at_ms >= $2"
                    " AND (at_ms < $3 OR (at_ms = $3 AND seq < $4))"
                    f" ORDER BY at_ms DESC, seq DESC LIMIT {limit + 1}",
                    account_id,
                    since_ms,
                    at,
                    seq,
                )
            )
            more = more or len(found) > limit
            for row in found[:limit]:
                event: dict[str, Any] = _detail(row["detail"])
                if source == "r":
                    event["channel"] = row["channel"]
                # The base fields win over a detail that names them too.
                event.update(
                    id=f"{source}{row['seq']}",
                    at=iso_utc_ms(int(row["at_ms"])),
                    type=row["type"],
                    key_id=None if row["key_id"] is None else str(row["key_id"]),
                )
                rows.append((int(row["at_ms"]), source, int(row["seq"]), event))
        rows.sort(key=lambda r: (r[0], _RANK[r[1]], r[2]), reverse=True)
        more = more or len(rows) > limit
        rows = rows[:limit]
        next_cursor = None
        if more and rows:
            last = rows[-1]
            next_cursor = f"{last[0]}.{last[1]}{last[2]}"
        ordered = [
            {"id": e["id"], "at": e["at"], "type": e["type"], "key_id": e["key_id"], **e}
            for *_, e in rows
        ]
        return AuditPage(ordered, next_cursor)

    async def prune(self, before_ms: int) -> tuple[int, bool]:
        """Delete one batch of the events older than ``before_ms``: of the accounts' table, and
        of the relay's where it shares the database (PostgreSQL). Returns the rows deleted and
        whether more may be left (call again)."""
        tables = ["audit_events"] + ([] if self._db.dialect == "sqlite" else ["relay_audit"])
        deleted, more = 0, False
        for table in tables:
            count = await self._db.execute(
                f"DELETE FROM {table} WHERE seq IN (SELECT seq FROM {table}"
                f" WHERE at_ms < $1 ORDER BY at_ms LIMIT {_PRUNE_BATCH})",
                before_ms,
            )
            deleted += count
            more = more or count == _PRUNE_BATCH
        return deleted, more


async def _missing_table_is_empty(call: Any) -> list[Any]:
    """The rows of ``call``; none if the relay's table is not there yet (a relay file made by a
    release before 0012, still to be migrated): the page then shows the accounts' events."""
    try:
        rows: list[Any] = await call
    except DatabaseError as exc:
        if "no such table" in str(exc) or "does not exist" in str(exc):
            return []
        raise
    return rows
