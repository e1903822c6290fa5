"""The store-backed authority: authenticates API keys and JWTs, mints JWTs, tracks key use.

It is the concrete :class:`~static.auth.TokenVerifier` the relay consumes. Revocation is never
cached: every check of a key (direct, or behind a JWT) is one indexed query, so a key revoked by
any process sharing the store fails from that moment. ``last_used_at`` writes are coalesced in
memory and flushed every ``last_used_flush_seconds`` and at shutdown; readers in this process see
the pending values through :meth:`Authority.last_used`.

Keys end three ways besides DELETE: at their expiry, and at the end of a roll's grace. Both are
exact (every check compares with the clock); a sweep every ``key_sweep_seconds`` then records
them (``revoked_at`` of a rolled key, the ``key.expired`` event) and tells the revocation
listeners, and an hourly prune keeps the audit log within ``audit_retention_days``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial

import trio

from static._settings import ApiSettings
from static.auth._keys import hash_api_key, is_api_key
from static.auth._principal import Principal, Unauthenticated
from static.auth._tokens import (
    ALGORITHM,
    SigningKey,
    TokenRules,
    TokenVerifierCore,
    is_uuid,
    mint_token,
)
from static.store import (
    AccountStore,
    AuditStore,
    Database,
    DatabaseError,
    KeyOwner,
    SigningKeyRecord,
)

__all__ = ["INVALID_KEY", "KEY_EXPIRED", "Authority", "IssuedToken", "open_authority"]

#: The spec's text for an API key that is unknown or revoked.
INVALID_KEY = "invalid or revoked api key"
#: A key past its ``expires_at`` (directly, or behind a JWT minted from it).
KEY_EXPIRED = "api key expired"

_log = logging.getLogger("static.auth")


@dataclass(frozen=True, slots=True)
class IssuedToken:
    access_token: str
    expires_in: int


class Authority:
    """Credentials in, principals out. Build it with :func:`open_authority`."""

    def __init__(
        self, store: AccountStore, signing_keys: list[SigningKey], settings: ApiSettings
    ) -> None:
        self.store = store
        self._rules = TokenRules(
            issuer=settings.token_issuer,
            audience=settings.token_audience,
            ttl_seconds=settings.token_ttl_seconds,
        )
        # The oldest active key signs, so servers sharing a store agree; all active keys verify.
        self._signing_key = signing_keys[0]
        self._signing_keys = signing_keys
        self._verifier = TokenVerifierCore(signing_keys, self._rules)
        self._pending_uses: dict[str, datetime] = {}
        self._revocation_listeners: list[Callable[[str], None]] = []

    # -- keys ending ------------------------------------------------------------------------

    def add_revocation_listener(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(key_id)`` whenever a key stops working for good: revoked by DELETE,
        a rolled key's grace swept, an expired key noticed by the sweep. It runs on the event
        loop, so it must not block; an exception it raises is logged and ignored."""
        self._revocation_listeners.append(listener)

    def _ended(self, key_ids: Sequence[str]) -> None:
        for key_id in key_ids:
            for listener in self._revocation_listeners:
                try:
                    listener(key_id)
                except Exception:  # noqa: BLE001  (a listener's bug must not fail the revocation)
                    _log.exception("a revocation listener failed for key %s", key_id)

    async def revoke_key(self, account_id: str, key_id: str, *, actor: str) -> bool:
        """DELETE /v1/keys/:id: revoke the account's key; False if there is no such key."""
        revoked = await self.store.revoke_key(
            account_id, key_id, now=datetime.now(UTC), actor=actor
        )
        if revoked:
            self._ended([key_id])
        return revoked

    async def sweep_keys(self) -> None:
        """One sweep (see the module docstring); the listeners hear of what it ended."""
        swept = await self.store.sweep_keys(datetime.now(UTC))
        self._ended(swept.revoked + swept.expired)

    @staticmethod
    def _working(owner: KeyOwner | None) -> KeyOwner:
        """``owner`` if its key works now; else the 401 that says why."""
        if owner is None:
            raise Unauthenticated(INVALID_KEY)
        now = datetime.now(UTC)
        # Past a roll's grace the key counts as revoked (the sweep soon says so in the store).
        if owner.grace_ends_at is not None and owner.grace_ends_at <= now:
            raise Unauthenticated(INVALID_KEY)
        if owner.expires_at is not None and owner.expires_at <= now:
            raise Unauthenticated(KEY_EXPIRED)
        return owner

    # -- API keys ---------------------------------------------------------------------------

    async def authenticate_key(self, secret: str) -> KeyOwner:
        """The active key ``secret`` and its account; records the use."""
        if not is_api_key(secret):
            raise Unauthenticated(INVALID_KEY)
        owner = self._working(await self.store.owner_of_secret(hash_api_key(secret)))
        self._pending_uses[owner.key_id] = datetime.now(UTC)
        return owner

    def last_used(self, key_id: str) -> datetime | None:
        """A use of ``key_id`` not written to the store yet, if any."""
        return self._pending_uses.get(key_id)

    async def flush_key_uses(self) -> None:
        """Write the pending ``last_used_at`` updates."""
        if not self._pending_uses:
            return
        # Still pending (and shown by last_used) until written: a list read while the write
        # is under way would otherwise see neither the pending use nor the stored one.
        pending = dict(self._pending_uses)
        await self.store.record_key_uses(pending.items())
        for key_id, when in pending.items():
            # A newer use recorded meanwhile stays for the next flush.
            if self._pending_uses.get(key_id) == when:
                del self._pending_uses[key_id]

    # -- JWTs -------------------------------------------------------------------------------

    def mint(self, owner: KeyOwner) -> IssuedToken:
        """A JWT for the account of ``owner``, tied to its key and its channel patterns; it
        ends with the key if the key ends sooner (expiry, a roll's grace)."""
        now = time.time()
        issued = math.floor(now)
        ttl = self._rules.ttl_seconds
        not_after = None
        if owner.ends_at is not None:
            # Whole seconds, rounded down: the token never outlives the key.
            not_after = math.floor(owner.ends_at.timestamp())
            if not_after <= issued:
                raise Unauthenticated(KEY_EXPIRED)
            ttl = min(ttl, not_after - issued)
        token = mint_token(
            self._signing_key,
            self._rules,
            account_id=owner.account_id,
            key_id=owner.key_id,
            now=now,
            not_after=not_after,
            channels=owner.channels,
        )
        return IssuedToken(token, ttl)

    def jwks(self) -> dict[str, list[dict[str, str]]]:
        """The public keys that verify our tokens, as a JWK Set."""
        return {"keys": [key.public_jwk() for key in self._signing_keys]}

    async def authenticate_token(self, token: str) -> KeyOwner:
        """A JWT's key (still active) and account, in one query."""
        claims = self._verifier.verify(token)
        owner = self._working(await self.store.owner_of_key(claims.key_id))
        if owner.account_id != claims.account_id:
            raise Unauthenticated(INVALID_KEY)
        return owner

    # -- TokenVerifier (the relay's port) ---------------------------------------------------

    async def verify_token(self, token: str) -> Principal:
        claims = self._verifier.verify(token)
        self._working(await self.store.owner_of_key(claims.key_id))
        return Principal(
            account_id=claims.account_id,
            key_id=claims.key_id,
            expires_at=claims.expires_at,
            channels=claims.channels,
        )

    async def key_is_active(self, key_id: str) -> bool:
        # A malformed id is no key (and PostgreSQL would refuse to compare it with a UUID).
        return is_uuid(key_id) and await self.store.key_is_active(key_id, datetime.now(UTC))

    async def inactive_keys(self, key_ids: Sequence[str]) -> set[str]:
        return await self.store.inactive_keys(key_ids, datetime.now(UTC))


async def _load_signing_keys(store: AccountStore) -> list[SigningKey]:
    records = await store.signing_keys()
    if not records:
        fresh = SigningKey.generate()
        await store.add_signing_key_if_none(
            SigningKeyRecord(fresh.kid, ALGORITHM, fresh.to_pem(), datetime.now(UTC))
        )
        records = await store.signing_keys()
    keys = [SigningKey.from_pem(r.private_key_pem) for r in records if r.algorithm == ALGORITHM]
    if not keys:
        raise RuntimeError(f"the store holds no active {ALGORITHM} signing key")
    return keys


@asynccontextmanager
async def open_authority(db: Database, settings: ApiSettings) -> AsyncIterator[Authority]:
    """The authority over ``db`` (its signing key created on first start), flushing key use in
    the background; the last flush runs on exit."""
    store = AccountStore(db)
    authority = Authority(store, await _load_signing_keys(store), settings)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            partial(
                _every,
                settings.last_used_flush_seconds,
                authority.flush_key_uses,
                "record key uses",
                at_once=False,
            )
        )
        nursery.start_soon(
            partial(
                _every,
                settings.key_sweep_seconds,
                authority.sweep_keys,
                "sweep ended keys",
                at_once=True,
            )
        )
        nursery.start_soon(_prune_forever, AuditStore(db), settings.audit_retention_days)
        try:
            yield authority
        finally:
            nursery.cancel_scope.cancel()
            with trio.CancelScope(shield=True):
                try:
                    await authority.flush_key_uses()
                except DatabaseError as exc:
                    _log.error("could not record the last key uses: %s", exc)


async def _every(
    interval: float, work: Callable[[], Awaitable[None]], what: str, *, at_once: bool
) -> None:
    """Run ``work`` every ``interval`` seconds (first at once, or after one interval); a store
    failure is logged and retried at the next turn. Each run is shielded: a store call
    cancelled half-way (at shutdown) can leave a PostgreSQL connection stuck in trio-asyncio,
    and each is one short transaction."""
    if not at_once:
        await trio.sleep(interval)
    while True:
        try:
            with trio.CancelScope(shield=True):
                await work()
        except DatabaseError as exc:
            _log.warning("could not %s (will retry): %s", what, exc)
        await trio.sleep(interval)


async def _prune_forever(audit: AuditStore, retention_days: float) -> None:
    """Prune the audit log at start, then hourly (more often for a retention under 2 hours,
    so that it is kept within about half of itself); one shielded batch at a time."""
    retention_s = retention_days * 86_400
    interval = min(3600.0, max(1.0, retention_s / 2))
    while True:
        pruned, more = 0, True
        try:
            while more:
                with trio.CancelScope(shield=True):
                    count, more = await audit.prune(int((time.time() - retention_s) * 1000))
                pruned += count
                await trio.lowlevel.checkpoint()
        except DatabaseError as exc:
            _log.warning("could not prune the audit log (will retry): %s", exc)
        if pruned:
            _log.info("pruned %d audit events older than %g days", pruned, retention_days)
        await trio.sleep(interval)
