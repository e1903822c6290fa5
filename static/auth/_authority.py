"""The store-backed authority: authenticates API keys and JWTs, mints JWTs, tracks key use.

It is the concrete :class:`~static.auth.TokenVerifier` the relay consumes. Revocation is never
cached: every check of a key (direct, or behind a JWT) is one indexed query, so a key revoked by
any process sharing the store fails from that moment. ``last_used_at`` writes are coalesced in
memory and flushed every ``last_used_flush_seconds`` and at shutdown; readers in this process see
the pending values through :meth:`Authority.last_used`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime

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
from static.store import AccountStore, Database, DatabaseError, KeyOwner, SigningKeyRecord

__all__ = ["INVALID_KEY", "Authority", "IssuedToken", "open_authority"]

#: The spec's text for an API key that is unknown or revoked.
INVALID_KEY = "invalid or revoked api key"

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

    # -- API keys ---------------------------------------------------------------------------

    async def authenticate_key(self, secret: str) -> KeyOwner:
        """The active key ``secret`` and its account; records the use."""
        if not is_api_key(secret):
            raise Unauthenticated(INVALID_KEY)
        owner = await self.store.owner_of_secret(hash_api_key(secret))
        if owner is None:
            raise Unauthenticated(INVALID_KEY)
        self._pending_uses[owner.key_id] = datetime.now(UTC)
        return owner

    def last_used(self, key_id: str) -> datetime | None:
        """A use of ``key_id`` not written to the store yet, if any."""
        return self._pending_uses.get(key_id)

    async def flush_key_uses(self) -> None:
        """Write the pending ``last_used_at`` updates."""
        if not self._pending_uses:
            return
        pending, self._pending_uses = self._pending_uses, {}
        try:
            await self.store.record_key_uses(pending.items())
        except BaseException:
            # Keep them for the next flush (newer uses recorded meanwhile win).
            self._pending_uses = {**pending, **self._pending_uses}
            raise

    # -- JWTs -------------------------------------------------------------------------------

    def mint(self, owner: KeyOwner) -> IssuedToken:
        """A JWT for the account of ``owner``, tied to its key."""
        token = mint_token(
            self._signing_key,
            self._rules,
            account_id=owner.account_id,
            key_id=owner.key_id,
            now=time.time(),
        )
        return IssuedToken(token, self._rules.ttl_seconds)

    def jwks(self) -> dict[str, list[dict[str, str]]]:
        """The public keys that verify our tokens, as a JWK Set."""
        return {"keys": [key.public_jwk() for key in self._signing_keys]}

    async def authenticate_token(self, token: str) -> KeyOwner:
        """A JWT's key (still active) and account, in one query."""
        claims = self._verifier.verify(token)
        owner = await self.store.owner_of_key(claims.key_id)
        if owner is None or owner.account_id != claims.account_id:
            raise Unauthenticated(INVALID_KEY)
        return owner

    # -- TokenVerifier (the relay's port) ---------------------------------------------------

    async def verify_token(self, token: str) -> Principal:
        claims = self._verifier.verify(token)
        if not await self.store.key_is_active(claims.key_id):
            raise Unauthenticated(INVALID_KEY)
        return Principal(
            account_id=claims.account_id, key_id=claims.key_id, expires_at=claims.expires_at
        )

    async def key_is_active(self, key_id: str) -> bool:
        # A malformed id is no key (and PostgreSQL would refuse to compare it with a UUID).
        return is_uuid(key_id) and await self.store.key_is_active(key_id)


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
        nursery.start_soon(_flush_forever, authority, settings.last_used_flush_seconds)
        try:
            yield authority
        finally:
            nursery.cancel_scope.cancel()
            with trio.CancelScope(shield=True):
                try:
                    await authority.flush_key_uses()
                except DatabaseError as exc:
                    _log.error("could not record the last key uses: %s", exc)


async def _flush_forever(authority: Authority, interval: float) -> None:
    while True:
        await trio.sleep(interval)
        try:
            await authority.flush_key_uses()
        except DatabaseError as exc:
            _log.warning("could not record key uses (will retry): %s", exc)
