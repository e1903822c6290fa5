"""Accounts, API keys and signing keys: every query of the HTTP API, written once for both backends.

Timestamps are aware UTC datetimes in Python; PostgreSQL stores them as ``timestamptz`` and
SQLite as fixed-width ISO 8601 text (so text order is time order). Ids are UUID strings.
The authentication lookups are one indexed query each (docs/design.md §7: one query per request).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from static._time import iso_utc
from static.store._database import Connection, Database, IntegrityError, Row

__all__ = [
    "ALL_SCOPES",
    "AccountRecord",
    "AccountStore",
    "EmailTaken",
    "KeyLimitReached",
    "KeyOwner",
    "KeyRecord",
    "NewKey",
    "SigningKeyRecord",
    "SweptKeys",
]

_SQLITE_TIME = "%Y-%m-%dT%H:%M:%S.%fZ"
#: What a key may do: "keys" (manage the account's keys, read its audit log) and "channels"
#: (mint JWTs for the relay). A key made without a choice has both (the spec's behaviour).
ALL_SCOPES: tuple[str, ...] = ("keys", "channels")
_ALL_SCOPES_JSON = json.dumps(list(ALL_SCOPES), separators=(",", ":"))
#: Ids per query of :meth:`AccountStore.inactive_keys` (a bound on one statement's size).
_IDS_PER_QUERY = 500
#: Keys per transaction of the sweep (each batch is short; the next sweep takes the rest).
_SWEEP_BATCH = 500
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


class EmailTaken(Exception):
    """An account with this email (compared case-insensitively) exists already."""


class KeyLimitReached(Exception):
    """The account has as many active keys as it may have."""


def _json_list(value: Any) -> tuple[str, ...] | None:
    return None if value is None else tuple(json.loads(value))


def _ms(value: datetime) -> int:
    return int(value.timestamp() * 1000)


@dataclass(frozen=True, slots=True)
class AccountRecord:
    id: str
    email: str
    name: str | None
    plan_tier: str


@dataclass(frozen=True, slots=True)
class KeyRecord:
    id: str
    account_id: str
    key_prefix: str
    name: str
    created_at: datetime
    last_used_at: datetime | None
    scopes: tuple[str, ...] = ALL_SCOPES
    #: Channel patterns the key's JWTs are limited to; None: every channel.
    channels: tuple[str, ...] | None = None
    expires_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class NewKey:
    """A key about to be stored: its id, the digest of its secret, and what may be shown."""

    id: str
    digest: bytes
    key_prefix: str
    name: str
    scopes: tuple[str, ...] = ALL_SCOPES
    channels: tuple[str, ...] | None = None
    #: The lifetime asked for (None: the key never expires); it ends that long after creation.
    lifetime_seconds: int | None = None


@dataclass(frozen=True, slots=True)
class KeyOwner:
    """An active key and its account (None only if the account row is gone)."""

    key_id: str
    account_id: str
    account: AccountRecord | None
    scopes: tuple[str, ...] = ALL_SCOPES
    channels: tuple[str, ...] | None = None
    expires_at: datetime | None = None
    #: The end of a rolled key's grace (it stops working then).
    grace_ends_at: datetime | None = None

    @property
    def ends_at(self) -> datetime | None:
        """When the key stops working, if ever (its expiry or its grace end, the earlier)."""
        ends = [t for t in (self.expires_at, self.grace_ends_at) if t is not None]
        return min(ends) if ends else None


@dataclass(frozen=True, slots=True)
class SweptKeys:
    """What one sweep ended: rolled keys past their grace (now revoked) and keys newly seen
    expired."""

    revoked: list[str]
    expired: list[str]


@dataclass(frozen=True, slots=True)
class SigningKeyRecord:
    kid: str
    algorithm: str
    private_key_pem: str
    created_at: datetime


# The active key and its account, one indexed lookup. LEFT JOIN so that a key whose account is
# gone is told apart from a key that does not exist (404 versus 401).
_OWNER = (
    "SELECT k.id AS key_id, k.account_id AS key_account_id, a.id AS account_id, a.email,"
    " a.name, a.plan_tier, k.scopes, k.channels, k.expires_at, k.grace_ends_at"
    " FROM api_keys k LEFT JOIN accounts a ON a.id = k.account_id"
    " WHERE {where} AND k.revoked_at IS NULL"
)
_OWNER_BY_DIGEST = _OWNER.format(where="k.key_hash = $1")
_OWNER_BY_ID = _OWNER.format(where="k.id = $1")


class AccountStore:
    """The account and key queries over one :class:`~static.store.Database`."""

    def __init__(self, db: Database) -> None:
        self._db = db
        self._sqlite = db.dialect == "sqlite"

    # -- conversions ------------------------------------------------------------------------

    def _time_in(self, value: datetime) -> Any:
        return value.astimezone(UTC).strftime(_SQLITE_TIME) if self._sqlite else value

    def _time_out(self, value: Any) -> datetime:
        if isinstance(value, datetime):
            return value.astimezone(UTC)
        # fromisoformat (C, and "Z"-aware since 3.11) is ~40x faster than strptime.
        return datetime.fromisoformat(value)

    def _maybe_time_out(self, value: Any) -> datetime | None:
        return None if value is None else self._time_out(value)

    def _account(self, row: Row, prefix: str = "") -> AccountRecord:
        return AccountRecord(
            id=str(row[f"{prefix}id"]),
            email=row["email"],
            name=row["name"],
            plan_tier=row["plan_tier"],
        )

    def _owner(self, row: Row) -> KeyOwner:
        account = None if row["account_id"] is None else self._account(row, "account_")
        return KeyOwner(
            key_id=str(row["key_id"]),
            account_id=str(row["key_account_id"]),
            account=account,
            scopes=_json_list(row["scopes"]) or ALL_SCOPES,
            channels=_json_list(row["channels"]),
            expires_at=self._maybe_time_out(row["expires_at"]),
            grace_ends_at=self._maybe_time_out(row["grace_ends_at"]),
        )

    def _key(self, row: Row) -> KeyRecord:
        return KeyRecord(
            id=str(row["id"]),
            account_id=str(row["account_id"]),
            key_prefix=row["key_prefix"],
            name=row["name"],
            created_at=self._time_out(row["created_at"]),
            last_used_at=self._maybe_time_out(row["last_used_at"]),
            scopes=_json_list(row["scopes"]) or ALL_SCOPES,
            channels=_json_list(row["channels"]),
            expires_at=self._maybe_time_out(row["expires_at"]),
        )

    def _working(self, now: datetime, alias: str = "") -> tuple[str, Any]:
        """The condition (with ``$N`` left as ``{n}``) that a key works at ``now``, and its
        argument: not revoked, not expired, not past a roll's grace."""
        a = alias
        return (
            f"{a}revoked_at IS NULL AND ({a}expires_at IS NULL OR {a}expires_at > ${{n}})"
            f" AND ({a}grace_ends_at IS NULL OR {a}grace_ends_at > ${{n}})",
            self._time_in(now),
        )

    async def _event(
        self,
        tx: Connection,
        account_id: str,
        at: datetime,
        type_: str,
        actor: str | None,
        **detail: Any,
    ) -> None:
        """One audit event, in the transaction of its change (never a secret in ``detail``)."""
        await tx.execute(
            "INSERT INTO audit_events (account, at_ms, type, key_id, detail)"
            " VALUES ($1, $2, $3, $4, $5)",
            account_id,
            _ms(at),
            type_,
            actor,
            json.dumps(detail, separators=(",", ":")),
        )

    # -- accounts and keys ------------------------------------------------------------------

    async def create_account(
        self,
        *,
        account_id: str,
        email: str,
        name: str | None,
        first_key: NewKey,
        now: datetime,
    ) -> AccountRecord:
        """Store a new account and its first key atomically; :class:`EmailTaken` on a clash."""
        created = self._time_in(now)
        try:
            async with self._db.transaction() as tx:
                await tx.execute(
                    "INSERT INTO accounts (id, email, email_key, name, plan_tier, created_at)"
                    " VALUES ($1, $2, $3, $4, 'free', $5)",
                    account_id,
                    email,
                    email.lower(),
                    name,
                    created,
                )
                await self._insert_key(tx, account_id, first_key, now)
                await self._event(
                    tx,
                    account_id,
                    now,
                    "key.created",
                    None,
                    target_key_id=first_key.id,
                    name=first_key.name,
                )
        except IntegrityError as exc:
            # The only constraint a fresh random id and key can break is the email's.
            raise EmailTaken(email) from exc
        return AccountRecord(account_id, email, name, "free")

    async def _insert_key(
        self, tx: Connection, account_id: str, key: NewKey, now: datetime
    ) -> KeyRecord:
        expires = None
        if key.lifetime_seconds is not None:
            expires = now + timedelta(seconds=key.lifetime_seconds)
        await tx.execute(
            "INSERT INTO api_keys (id, account_id, key_hash, key_prefix, name, created_at,"
            " scopes, channels, expires_at, lifetime_seconds)"
            " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
            key.id,
            account_id,
            key.digest,
            key.key_prefix,
            key.name,
            self._time_in(now),
            json.dumps(list(key.scopes), separators=(",", ":")),
            None if key.channels is None else json.dumps(list(key.channels)),
            None if expires is None else self._time_in(expires),
            key.lifetime_seconds,
        )
        return KeyRecord(
            key.id,
            account_id,
            key.key_prefix,
            key.name,
            now,
            None,
            key.scopes,
            key.channels,
            expires,
        )

    async def _count_working(
        self, tx: Connection, account_id: str, now: datetime, max_active: int
    ) -> None:
        """Lock the account's key creation and refuse a key past ``max_active`` working ones."""
        if not self._sqlite:
            # Serialise key creation per account so two racing requests cannot both pass
            # the limit (SQLite transactions are serialised by BEGIN IMMEDIATE already).
            await tx.execute("SELECT 1 FROM accounts WHERE id = $1 FOR UPDATE", account_id)
        working, at = self._working(now)
        active = await tx.fetchval(
            "SELECT count(*) FROM api_keys WHERE account_id = $1 AND " + working.format(n=2),
            account_id,
            at,
        )
        if active >= max_active:
            raise KeyLimitReached(account_id)

    async def create_key(
        self,
        account_id: str,
        key: NewKey,
        *,
        now: datetime,
        max_active: int,
        actor: str | None = None,
    ) -> KeyRecord:
        """Store a new key unless the account has ``max_active`` active keys already; the
        audit event names ``actor``, the key that made it."""
        async with self._db.transaction() as tx:
            await self._count_working(tx, account_id, now, max_active)
            record = await self._insert_key(tx, account_id, key, now)
            await self._event(
                tx, account_id, now, "key.created", actor, target_key_id=key.id, name=key.name
            )
        return record

    async def roll_key(
        self,
        account_id: str,
        key_id: str,
        new: NewKey,
        *,
        now: datetime,
        grace_seconds: int,
        max_active: int,
        default_lifetime: int | None = None,
        actor: str | None = None,
    ) -> KeyRecord | None:
        """Replace the account's working key ``key_id`` (not rolled before) by ``new``, which
        takes its name, scopes, channels and original lifetime (``default_lifetime`` for a key
        that had none, when a maximum applies); the old key works ``grace_seconds`` more. None
        if there is no such key; :class:`KeyLimitReached` as :meth:`create_key`."""
        async with self._db.transaction() as tx:
            await self._count_working(tx, account_id, now, max_active)
            working, at = self._working(now)
            old = await tx.fetchrow(
                "SELECT name, scopes, channels, lifetime_seconds FROM api_keys"
                " WHERE id = $1 AND account_id = $2 AND grace_ends_at IS NULL AND "
                + working.format(n=3),
                key_id,
                account_id,
                at,
            )
            if old is None:
                return None
            lifetime = old["lifetime_seconds"]
            successor = NewKey(
                new.id,
                new.digest,
                new.key_prefix,
                old["name"],
                _json_list(old["scopes"]) or ALL_SCOPES,
                _json_list(old["channels"]),
                default_lifetime if lifetime is None else int(lifetime),
            )
            await tx.execute(
                "UPDATE api_keys SET grace_ends_at = $1 WHERE id = $2",
                self._time_in(now + timedelta(seconds=grace_seconds)),
                key_id,
            )
            record = await self._insert_key(tx, account_id, successor, now)
            await self._event(
                tx,
                account_id,
                now,
                "key.rolled",
                actor,
                target_key_id=key_id,
                new_key_id=new.id,
                name=successor.name,
                grace_seconds=grace_seconds,
            )
        return record

    async def active_keys(self, account_id: str, now: datetime | None = None) -> list[KeyRecord]:
        """The account's working keys (not revoked, expired or past a roll's grace), newest
        first."""
        working, at = self._working(now or datetime.now(UTC))
        rows = await self._db.fetch(
            "SELECT id, account_id, key_prefix, name, created_at, last_used_at, scopes,"
            " channels, expires_at FROM api_keys WHERE account_id = $1 AND "
            + working.format(n=2)
            + " ORDER BY created_at DESC, seq DESC",
            account_id,
            at,
        )
        return [self._key(row) for row in rows]

    async def revoke_key(
        self, account_id: str, key_id: str, *, now: datetime, actor: str | None = None
    ) -> bool:
        """Revoke the account's key ``key_id`` (not revoked, expired or past its grace); False
        if there is no such key."""
        working, at = self._working(now)
        async with self._db.transaction() as tx:
            changed = await tx.execute(
                "UPDATE api_keys SET revoked_at = $1 WHERE id = $2 AND account_id = $3 AND "
                + working.format(n=1),
                at,
                key_id,
                account_id,
            )
            if changed == 1:
                await self._event(
                    tx,
                    account_id,
                    now,
                    "key.revoked",
                    actor,
                    target_key_id=key_id,
                    reason="deleted",
                )
        return changed == 1

    async def sweep_keys(self, now: datetime) -> SweptKeys:
        """Revoke rolled keys past their grace (``revoked_at`` = the grace end, event
        ``key.revoked`` with reason ``rolled``) and note keys newly expired (event
        ``key.expired``, once per key): one bounded batch of each, in one transaction."""
        at = self._time_in(now)
        # Mostly there is nothing to do: two indexed reads then, no write transaction.
        due = await self._db.fetchval(
            "SELECT 1 WHERE EXISTS (SELECT 1 FROM api_keys WHERE revoked_at IS NULL"
            " AND grace_ends_at IS NOT NULL AND grace_ends_at <= $1)"
            " OR EXISTS (SELECT 1 FROM api_keys WHERE revoked_at IS NULL"
            " AND expires_at IS NOT NULL AND expiry_noted = 0 AND expires_at <= $1)",
            at,
        )
        if due is None:
            return SweptKeys([], [])
        # Several API processes may share a PostgreSQL store: each row is swept by one.
        skip = "" if self._sqlite else " FOR UPDATE SKIP LOCKED"
        async with self._db.transaction() as tx:
            rolled = await tx.fetch(
                "SELECT id, account_id, grace_ends_at FROM api_keys"
                " WHERE revoked_at IS NULL AND grace_ends_at IS NOT NULL AND grace_ends_at <= $1"
                f" LIMIT {_SWEEP_BATCH}{skip}",
                at,
            )
            for row in rolled:
                await tx.execute(
                    "UPDATE api_keys SET revoked_at = grace_ends_at WHERE id = $1", row["id"]
                )
                # At the sweep's time, not the grace end's: an event written behind events
                # already read would escape a reader paging or polling the log by its cursor.
                await self._event(
                    tx,
                    str(row["account_id"]),
                    now,
                    "key.revoked",
                    None,
                    target_key_id=str(row["id"]),
                    reason="rolled",
                    revoked_at=iso_utc(self._time_out(row["grace_ends_at"])),
                )
            expired = await tx.fetch(
                "SELECT id, account_id, expires_at FROM api_keys"
                " WHERE revoked_at IS NULL AND expires_at IS NOT NULL AND expiry_noted = 0"
                f" AND expires_at <= $1 LIMIT {_SWEEP_BATCH}{skip}",
                at,
            )
            for row in expired:
                await tx.execute("UPDATE api_keys SET expiry_noted = 1 WHERE id = $1", row["id"])
                await self._event(
                    tx,
                    str(row["account_id"]),
                    now,
                    "key.expired",
                    None,
                    target_key_id=str(row["id"]),
                    expires_at=iso_utc(self._time_out(row["expires_at"])),
                )
        return SweptKeys([str(r["id"]) for r in rolled], [str(r["id"]) for r in expired])

    async def inactive_keys(self, key_ids: Sequence[str], now: datetime) -> set[str]:
        """Of ``key_ids``, those that do not work at ``now``: unknown, revoked, expired, past
        a roll's grace, or not a key id at all. One query per 500 ids."""
        inactive = {k for k in key_ids if not isinstance(k, str) or not _UUID.fullmatch(k)}
        wanted = sorted({k for k in key_ids if k not in inactive})
        working, at = self._working(now)
        for start in range(0, len(wanted), _IDS_PER_QUERY):
            chunk = wanted[start : start + _IDS_PER_QUERY]
            if self._sqlite:
                where = "id IN (SELECT value FROM json_each($1))"
                ids: Any = json.dumps(chunk)
            else:
                where = "id = ANY($1::uuid[])"
                ids = chunk
            rows = await self._db.fetch(
                f"SELECT id FROM api_keys WHERE {where} AND " + working.format(n=2), ids, at
            )
            found = {str(row["id"]) for row in rows}
            inactive.update(k for k in chunk if k not in found)
        return inactive

    async def probe_write(self, now_ms: int) -> None:
        """One small write transaction (the API's row of ``static_health``, migration 0006):
        ``/readyz`` is ready only if the store can *write*, not only answer a read."""
        async with self._db.transaction() as tx:
            await tx.execute(
                "INSERT INTO static_health (part, checked_at) VALUES ('api', $1)"
                " ON CONFLICT (part) DO UPDATE SET checked_at = excluded.checked_at",
                now_ms,
            )

    async def owner_of_secret(self, digest: bytes) -> KeyOwner | None:
        """The active key whose secret has SHA-256 ``digest``, with its account."""
        row = await self._db.fetchrow(_OWNER_BY_DIGEST, digest)
        return None if row is None else self._owner(row)

    async def owner_of_key(self, key_id: str) -> KeyOwner | None:
        """The active key ``key_id`` (a UUID string), with its account."""
        row = await self._db.fetchrow(_OWNER_BY_ID, key_id)
        return None if row is None else self._owner(row)

    async def key_is_active(self, key_id: str, now: datetime | None = None) -> bool:
        """Whether key ``key_id`` (a UUID string) exists and works at ``now``: not revoked,
        not expired, not past a roll's grace."""
        working, at = self._working(now or datetime.now(UTC))
        found = await self._db.fetchval(
            "SELECT 1 FROM api_keys WHERE id = $1 AND " + working.format(n=2), key_id, at
        )
        return found is not None

    async def record_key_uses(self, uses: Iterable[tuple[str, datetime]]) -> None:
        """Set ``last_used_at`` of each key to its time, unless a later one is stored."""
        rows = [(self._time_in(when), key_id) for key_id, when in uses]
        if rows:
            await self._db.executemany(
                "UPDATE api_keys SET last_used_at = $1"
                " WHERE id = $2 AND (last_used_at IS NULL OR last_used_at < $1)",
                rows,
            )

    # -- signing keys -----------------------------------------------------------------------

    async def signing_keys(self) -> list[SigningKeyRecord]:
        """The signing keys not retired, oldest first."""
        rows = await self._db.fetch(
            "SELECT kid, algorithm, private_key, created_at FROM signing_keys"
            " WHERE retired_at IS NULL ORDER BY created_at, kid"
        )
        return [
            SigningKeyRecord(
                row["kid"], row["algorithm"], row["private_key"], self._time_out(row["created_at"])
            )
            for row in rows
        ]

    async def add_signing_key_if_none(self, record: SigningKeyRecord) -> None:
        """Store ``record`` unless an active signing key exists (two starting servers agree)."""
        async with self._db.transaction() as tx:
            if not self._sqlite:
                await tx.execute("LOCK TABLE signing_keys IN EXCLUSIVE MODE")
            exists = await tx.fetchval("SELECT 1 FROM signing_keys WHERE retired_at IS NULL")
            if exists is None:
                await tx.execute(
                    "INSERT INTO signing_keys (kid, algorithm, private_key, created_at)"
                    " VALUES ($1, $2, $3, $4)",
                    record.kid,
                    record.algorithm,
                    record.private_key_pem,
                    self._time_in(record.created_at),
                )
