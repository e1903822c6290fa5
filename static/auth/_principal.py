"""Who a request acts for, and the one port the relay needs from the auth side."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = ["Principal", "TokenVerifier", "Unauthenticated"]


@dataclass(frozen=True, slots=True)
class Principal:
    """The account (and the API key behind the credential) a request acts for."""

    account_id: str
    #: The API key used directly, or the one a JWT was minted from.
    key_id: str
    #: Unix time at which the credential stops working (a JWT's ``exp``); None for an API key.
    expires_at: float | None = None
    #: The channel patterns (``org/namespace/service``, ``*`` matching any one component) the
    #: credential is limited to, from the JWT's ``channels`` claim; None: every channel.
    channels: tuple[str, ...] | None = None


class Unauthenticated(Exception):
    """A credential was missing, malformed, expired or revoked. ``str(exc)`` is safe to show."""


class TokenVerifier(Protocol):
    """What the relay needs to authenticate a call: verify a JWT, and re-check its key later."""

    async def verify_token(self, token: str) -> Principal:
        """Check a JWT's signature, ``aud``, ``exp``/``nbf`` and that its API key is still active;
        raise :class:`Unauthenticated` otherwise."""
        ...

    async def key_is_active(self, key_id: str) -> bool:
        """Whether the API key ``key_id`` exists and works: not revoked, not expired, not past a
        roll's grace (each voids its JWTs)."""
        ...

    async def inactive_keys(self, key_ids: Sequence[str]) -> set[str]:
        """Of ``key_ids``, those that do not work now (unknown, revoked, expired, past a roll's
        grace, or malformed)."""
        ...
