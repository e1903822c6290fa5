"""The relay's channel logs in the store: channels, entries, epoch starts, kept Welcomes.

Thin I/O only: the relay (``static.relay._log``) decides sequence numbers, epochs and
idempotency; this module reads and writes what it decided, a whole group commit in one
transaction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from static.store._database import Database, IntegrityError
from static.store._sqlite import SQLiteDatabase, SyncWriter

__all__ = [
    "ChannelExists",
    "ChannelRecord",
    "ChannelStore",
    "EntryRecord",
    "NewEntry",
    "NewWelcome",
    "SyncChannelWriter",
    "WelcomeRecord",
]


class ChannelExists(Exception):
    """A channel of that name already exists in that scope."""


@dataclass(frozen=True, slots=True)
class ChannelRecord:
    id: int
    scope: str
    name: str
    epoch: int
    head_seq: int


@dataclass(frozen=True, slots=True)
class EntryRecord:
    seq: int
    epoch: int
    content_type: int
    message: bytes


@dataclass(frozen=True, slots=True)
class NewEntry:
    channel_id: int
    seq: int
    epoch: int
    content_type: int
    #: The channel's epoch once this entry is appended.
    channel_epoch: int
    idempotency_key: bytes
    message: bytes


@dataclass(frozen=True, slots=True)
class NewWelcome:
    channel_id: int
    digest: bytes
    commit_seq: int
    epoch: int
    welcome: bytes
    key_package_refs: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class WelcomeRecord:
    welcome: bytes
    commit_seq: int
    epoch: int


class SyncChannelWriter:
    """:meth:`ChannelStore.append` and :meth:`ChannelStore.find_keys`, synchronous, for a job in
    the store's writer thread."""

    __slots__ = ("_writer",)

    def __init__(self, writer: SyncWriter) -> None:
        self._writer = writer

    def append(
        self,
        entries: Sequence[NewEntry],
        heads: Sequence[tuple[int, int, int]],
        epoch_starts: Sequence[tuple[int, int, int]],
        welcomes: Sequence[NewWelcome],
    ) -> None:
        self._writer.transact(_append_operations(entries, heads, epoch_starts, welcomes))

    def find_keys(self, channel_id: int, keys: Sequence[bytes]) -> dict[bytes, tuple[int, int]]:
        if not keys:
            return {}
        rows = self._writer.fetch(_find_keys_sql(len(keys)), channel_id, *keys)
        return {bytes(row[0]): (int(row[1]), int(row[2])) for row in rows}


class ChannelStore:
    """Channel logs on a :class:`~static.store.Database`."""

    def __init__(self, db: Database) -> None:
        self._db = db

    async def create_channel(self, scope: str, name: str) -> ChannelRecord:
        """Create ``name`` at epoch 0 in ``scope``; raise :class:`ChannelExists` if it exists."""
        try:
            async with self._db.transaction() as tx:
                channel_id = await tx.fetchval(
                    "INSERT INTO relay_channels (scope, name) VALUES ($1, $2) RETURNING id",
                    scope,
                    name,
                )
                await tx.execute(
                    "INSERT INTO relay_epochs (channel_id, epoch, start_seq) VALUES ($1, 0, 0)",
                    channel_id,
                )
        except IntegrityError:
            raise ChannelExists(name) from None
        return ChannelRecord(int(channel_id), scope, name, 0, 0)

    async def load_channel(self, scope: str, name: str) -> ChannelRecord | None:
        row = await self._db.fetchrow(
            "SELECT id, epoch, head_seq FROM relay_channels WHERE scope = $1 AND name = $2",
            scope,
            name,
        )
        if row is None:
            return None
        return ChannelRecord(int(row[0]), scope, name, int(row[1]), int(row[2]))

    async def find_keys(
        self, channel_id: int, keys: Sequence[bytes]
    ) -> dict[bytes, tuple[int, int]]:
        """The entries already holding these idempotency keys: key -> (seq, channel_epoch)."""
        if not keys:
            return {}
        rows = await self._db.fetch(_find_keys_sql(len(keys)), channel_id, *keys)
        return {bytes(row[0]): (int(row[1]), int(row[2])) for row in rows}

    @property
    def has_writer_thread(self) -> bool:
        """Whether :meth:`post_write` is available (SQLite: its writer has a thread of its own)."""
        return isinstance(self._db, SQLiteDatabase)

    def write_now_if_idle(self, job: Callable[[SyncChannelWriter], None]) -> bool:
        """Run ``job`` now if the writer is idle (see :meth:`SQLiteDatabase.write_now_if_idle`)."""
        assert isinstance(self._db, SQLiteDatabase)
        return self._db.write_now_if_idle(lambda writer: job(SyncChannelWriter(writer)))

    def post_write(self, job: Callable[[SyncChannelWriter], None]) -> None:
        """Run ``job`` in the store's writer thread (see :meth:`SQLiteDatabase.post_write`)."""
        assert isinstance(self._db, SQLiteDatabase)
        self._db.post_write(lambda writer: job(SyncChannelWriter(writer)))

    async def append(
        self,
        entries: Sequence[NewEntry],
        heads: Sequence[tuple[int, int, int]],
        epoch_starts: Sequence[tuple[int, int, int]],
        welcomes: Sequence[NewWelcome],
        on_commit: Callable[[], None] | None = None,
    ) -> None:
        """One group commit: the entries, the new (channel_id, head_seq, epoch) of each channel,
        the new (channel_id, epoch, start_seq) epoch starts and the kept Welcomes, atomically.
        ``on_commit`` is called once the transaction committed, before this returns (on SQLite
        a scheduling round before)."""
        operations = _append_operations(entries, heads, epoch_starts, welcomes)
        if isinstance(self._db, SQLiteDatabase):
            # The whole group commit in one worker-thread hop: on a quiet machine each hop costs
            # about as much as the durable commit itself, and a publish waits for all of them.
            await self._db.transact(operations, on_commit)
            return
        async with self._db.transaction() as tx:
            for sql, rows in operations:
                if rows:
                    await tx.executemany(sql, rows)
        if on_commit is not None:
            on_commit()

    async def checkpoint(self) -> None:
        """Fold the write-ahead log into the database, off the commit path (SQLite only)."""
        if isinstance(self._db, SQLiteDatabase):
            await self._db.checkpoint()

    async def read(self, channel_id: int, after_seq: int, limit: int) -> list[EntryRecord]:
        rows = await self._db.fetch(
            "SELECT seq, epoch, content_type, message FROM relay_entries"
            " WHERE channel_id = $1 AND seq > $2 ORDER BY seq LIMIT $3",
            channel_id,
            after_seq,
            limit,
        )
        return [EntryRecord(int(r[0]), int(r[1]), int(r[2]), bytes(r[3])) for r in rows]

    async def epoch_start(self, channel_id: int, epoch: int) -> int | None:
        """The seq after which ``epoch`` starts, or None if the channel never reached it."""
        value = await self._db.fetchval(
            "SELECT start_seq FROM relay_epochs WHERE channel_id = $1 AND epoch = $2",
            channel_id,
            epoch,
        )
        return None if value is None else int(value)

    async def fetch_welcome(
        self, channel_id: int, *, digest: bytes | None = None, key_package_ref: bytes | None = None
    ) -> WelcomeRecord | None:
        if digest is None:
            digest = await self._db.fetchval(
                "SELECT digest FROM relay_welcome_refs"
                " WHERE channel_id = $1 AND key_package_ref = $2",
                channel_id,
                key_package_ref,
            )
            if digest is None:
                return None
        row = await self._db.fetchrow(
            "SELECT welcome, commit_seq, epoch FROM relay_welcomes"
            " WHERE channel_id = $1 AND digest = $2",
            channel_id,
            bytes(digest),
        )
        if row is None:
            return None
        return WelcomeRecord(bytes(row[0]), int(row[1]), int(row[2]))


def _append_operations(
    entries: Sequence[NewEntry],
    heads: Sequence[tuple[int, int, int]],
    epoch_starts: Sequence[tuple[int, int, int]],
    welcomes: Sequence[NewWelcome],
) -> list[tuple[str, Sequence[Sequence[Any]]]]:
    operations: list[tuple[str, Sequence[Sequence[Any]]]] = [
        (
            "INSERT INTO relay_entries (channel_id, seq, epoch, content_type, channel_epoch,"
            " idempotency_key, message) VALUES ($1, $2, $3, $4, $5, $6, $7)",
            [
                (
                    e.channel_id,
                    e.seq,
                    e.epoch,
                    e.content_type,
                    e.channel_epoch,
                    e.idempotency_key,
                    e.message,
                )
                for e in entries
            ],
        ),
        (
            "UPDATE relay_channels SET head_seq = $2, epoch = $3 WHERE id = $1",
            [tuple(h) for h in heads],
        ),
        (
            "INSERT INTO relay_epochs (channel_id, epoch, start_seq) VALUES ($1, $2, $3)",
            [tuple(s) for s in epoch_starts],
        ),
    ]
    for w in welcomes:
        operations.append(
            (
                "INSERT INTO relay_welcomes (channel_id, digest, commit_seq, epoch, welcome)"
                " VALUES ($1, $2, $3, $4, $5) ON CONFLICT (channel_id, digest) DO NOTHING",
                [(w.channel_id, w.digest, w.commit_seq, w.epoch, w.welcome)],
            )
        )
        operations.append(
            (
                "INSERT INTO relay_welcome_refs (channel_id, key_package_ref, digest)"
                " VALUES ($1, $2, $3) ON CONFLICT (channel_id, key_package_ref)"
                " DO UPDATE SET digest = excluded.digest",
                [(w.channel_id, ref, w.digest) for ref in w.key_package_refs],
            )
        )
    return operations


def _find_keys_sql(count: int) -> str:
    placeholders = ", ".join(f"${i}" for i in range(2, count + 2))
    return (
        "SELECT idempotency_key, seq, channel_epoch FROM relay_entries"
        f" WHERE channel_id = $1 AND idempotency_key IN ({placeholders})"
    )
