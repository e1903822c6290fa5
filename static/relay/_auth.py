"""Who calls the relay, and keeping live streams honest about it (revocation, expiry)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import trio

from static.auth import Principal, TokenVerifier
from static.auth import Unauthenticated as TokenRefused
from static.relay._errors import RelayError, Unauthenticated
from static.relay._rules import bearer_token
from static.store import DatabaseError

__all__ = ["Authenticator", "Caller", "StreamGuard"]

ANONYMOUS_SCOPE = ""


@dataclass(frozen=True, slots=True)
class Caller:
    """An authenticated (or, with --allow-anonymous, anonymous) caller."""

    principal: Principal | None
    #: The scope channels are named in: the account id, or "" for anonymous callers.
    scope: str
    #: Whom rate limits count against: the API key, or the peer address when anonymous.
    agent: str


class StreamGuard:
    """A live stream's watch: ended when its key is revoked, its token expires, or the relay
    shuts down (``end``)."""

    def __init__(self, caller: Caller) -> None:
        self.caller = caller
        self.scope = trio.CancelScope()
        self.reason: RelayError | None = None
        if caller.principal is not None and caller.principal.expires_at is not None:
            remaining = caller.principal.expires_at - time.time()
            self.scope.deadline = trio.current_time() + max(0.0, remaining)

    def end(self, reason: RelayError) -> None:
        self.reason = reason
        self.scope.cancel()

    def outcome(self) -> RelayError | None:
        """Why the stream was ended (after its scope exited), or None."""
        if self.reason is not None:
            return self.reason
        if self.scope.cancelled_caught and trio.current_time() >= self.scope.deadline:
            return Unauthenticated("token expired")
        return None


class Authenticator:
    """Authenticates calls through the injected :class:`TokenVerifier`; watches live streams."""

    def __init__(
        self,
        verifier: TokenVerifier | None,
        *,
        allow_anonymous: bool,
        recheck_seconds: float,
    ) -> None:
        self._verifier = verifier
        self._allow_anonymous = allow_anonymous
        self._recheck_seconds = recheck_seconds
        self._guards: dict[str, set[StreamGuard]] = {}

    async def authenticate(
        self, metadata: tuple[tuple[str, str | bytes], ...], peer: str
    ) -> Caller:
        token = bearer_token(metadata)
        if token is None:
            if self._allow_anonymous:
                return Caller(None, ANONYMOUS_SCOPE, f"anonymous:{peer}")
            raise Unauthenticated("missing authorization metadata ('Bearer <token>')")
        if self._verifier is None:
            raise Unauthenticated("this relay has no token verifier: tokens cannot be checked")
        try:
            principal = await self._verifier.verify_token(token)
        except TokenRefused as exc:
            raise Unauthenticated(str(exc) or "invalid token") from None
        if principal.expires_at is not None and principal.expires_at <= time.time():
            raise Unauthenticated("token expired")
        return Caller(principal, principal.account_id, f"key:{principal.key_id}")

    def authenticate_now(
        self, metadata: tuple[tuple[str, str | bytes], ...], peer: str
    ) -> Caller | None:
        """The caller, when that takes no store access (an anonymous call this relay allows);
        otherwise None, and :meth:`authenticate` decides."""
        if not self._allow_anonymous:
            return None
        try:
            token = bearer_token(metadata)
        except RelayError:
            return None
        return Caller(None, ANONYMOUS_SCOPE, f"anonymous:{peer}") if token is None else None

    @contextmanager
    def watch(self, caller: Caller) -> Iterator[StreamGuard]:
        """A guard whose ``scope`` the stream runs in: cancelled on revocation or expiry."""
        guard = StreamGuard(caller)
        key = caller.principal.key_id if caller.principal is not None else None
        if key is not None:
            self._guards.setdefault(key, set()).add(guard)
        try:
            yield guard
        finally:
            if key is not None:
                guards = self._guards.get(key)
                if guards is not None:
                    guards.discard(guard)
                    if not guards:
                        del self._guards[key]

    async def run_revocation_checks(self) -> None:
        """Every ``recheck_seconds``, end the streams of keys that are no longer active."""
        if self._verifier is None:
            await trio.sleep_forever()
        verifier = self._verifier
        assert verifier is not None
        while True:
            await trio.sleep(self._recheck_seconds)
            for key in list(self._guards):
                try:
                    active = await verifier.key_is_active(key)
                except DatabaseError:
                    continue  # A store hiccup must not end the checks: try again next round.
                if not active:
                    for guard in list(self._guards.get(key, ())):
                        guard.end(Unauthenticated("api key revoked"))
