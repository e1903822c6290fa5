"""Accounts, API keys and signing keys: every query of the HTTP API, written once for both backends.

Timestamps are aware UTC datetimes in Python; PostgreSQL stores them as ``timestamptz`` and
SQLite as fixed-width ISO 8601 text (so text order is time order). Ids are UUID strings.
The authentication lookups are one indexed query each (docs/design.md §7: one query per request).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from static.store._database import Database, IntegrityError, Row

__all__ = [
    "AccountRecord",
    "AccountStore",
    "EmailTaken",
    "KeyLimitReached",
    "KeyOwner",
    "KeyRecord",
    "NewKey",
    "SigningKeyRecord",
]

_SQLITE_TIME = "%Y-%m-%dT%H:%M:%S.%fZ"


class EmailTaken(Exception):
    """An account with this email (compared case-insensitively) exists already."""


class KeyLimitReached(Exception):
    """The account has as many active keys as it may have."""


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


@dataclass(frozen=True, slots=True)
class NewKey:
    """A key about to be stored: its id, the digest of its secret, and what may be shown."""

    id: str
    digest: bytes
    key_prefix: str
    name: str


@dataclass(frozen=True, slots=True)
class KeyOwner:
    """An active key and its account (None only if the account row is gone)."""

    key_id: str
    account_id: str
    account: AccountRecord | None


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
    " a.name, a.plan_tier"
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
            key_id=str(row["key_id"]), account_id=str(row["key_account_id"]), account=account
        )

    def _key(self, row: Row) -> KeyRecord:
        return KeyRecord(
            id=str(row["id"]),
            account_id=str(row["account_id"]),
            key_prefix=row["key_prefix"],
            name=row["name"],
            created_at=self._time_out(row["created_at"]),
            last_used_at=self._maybe_time_out(row["last_used_at"]),
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
                await self._insert_key(tx, account_id, first_key, created)
        except IntegrityError as exc:
            # The only constraint a fresh random id and key can break is the email's.
            raise EmailTaken(email) from exc
        return AccountRecord(account_id, email, name, "free")

    @staticmethod
    async def _insert_key(tx: Any, account_id: str, key: NewKey, created: Any) -> None:
        await tx.execute(
            "INSERT INTO api_keys (id, account_id, key_hash, key_prefix, name, created_at)"
            " VALUES ($1, $2, $3, $4, $5, $6)",
            key.id,
            account_id,
            key.digest,
            key.key_prefix,
            key.name,
            created,
        )

    async def create_key(
        self, account_id: str, key: NewKey, *, now: datetime, max_active: int
    ) -> KeyRecord:
        """Store a new key unless the account has ``max_active`` active keys already."""
        created = self._time_in(now)
        async with self._db.transaction() as tx:
            if not self._sqlite:
                # Serialise key creation per account so two racing requests cannot both pass
                # the limit (SQLite transactions are serialised by BEGIN IMMEDIATE already).
                await tx.execute("SELECT 1 FROM accounts WHERE id = $1 FOR UPDATE", account_id)
            active = await tx.fetchval(
                "SELECT count(*) FROM api_keys WHERE account_id = $1 AND revoked_at IS NULL",
                account_id,
            )
            if active >= max_active:
                raise KeyLimitReached(account_id)
            await self._insert_key(tx, account_id, key, created)
        return KeyRecord(key.id, account_id, key.key_prefix, key.name, now, None)

    async def active_keys(self, account_id: str) -> list[KeyRecord]:
        """The account's active keys, newest first."""
        rows = await self._db.fetch(
            "SELECT id, account_id, key_prefix, name, created_at, last_used_at FROM api_keys"
            " WHERE account_id = $1 AND revoked_at IS NULL"
            " ORDER BY created_at DESC, seq DESC",
            account_id,
        )
        return [self._key(row) for row in rows]

    async def revoke_key(self, account_id: str, key_id: str, *, now: datetime) -> bool:
        """Revoke the account's active key ``key_id``; False if there is no such key."""
        changed = await self._db.execute(
            "UPDATE api_keys SET revoked_at = $1"
            " WHERE id = $2 AND account_id = $3 AND revoked_at IS NULL",
            self._time_in(now),
            key_id,
            account_id,
        )
        return changed == 1

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

    async def key_is_active(self, key_id: str) -> bool:
        """Whether key ``key_id`` (a UUID string) exists and is not revoked."""
        found = await self._db.fetchval(
            "SELECT 1 FROM api_keys WHERE id = $1 AND revoked_at IS NULL", key_id
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
