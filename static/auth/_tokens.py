"""JWTs: the signing key, minting and verification rules (pure; no I/O).

Tokens are EdDSA (Ed25519) JWS, so whoever verifies them (the relay) needs only the public keys
published as a JWKS. Header: ``alg`` ``EdDSA``, ``typ`` ``JWT``, ``kid`` (the RFC 7638 thumbprint
of the public key). Claims: ``iss``, ``sub`` (account id), ``aud``, ``iat``, ``nbf``, ``exp``,
``jti`` and ``key_id`` (the API key the token was minted from, whose revocation voids it); and
``channels`` (the key's channel patterns) only when the key is limited to some channels.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import math
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from static._settings import MAX_TOKEN_TTL_SECONDS
from static.auth._principal import Unauthenticated

__all__ = [
    "ALGORITHM",
    "INVALID_TOKEN",
    "MAX_CHANNEL_PATTERNS",
    "SigningKey",
    "TokenClaims",
    "TokenRules",
    "TokenVerifierCore",
    "is_uuid",
    "looks_like_jwt",
    "mint_token",
]

ALGORITHM = "EdDSA"
#: The one error text of every token that fails verification (which check failed is not shown).
INVALID_TOKEN = "invalid or expired token"
_REQUIRED = ["iss", "sub", "aud", "iat", "nbf", "exp", "jti", "key_id"]
#: Claims that are integers (seconds since the epoch); ``bool`` is not one, a float is not one.
_TIMES = ("iat", "nbf", "exp")
#: A bound on ``jti`` (ours are 32 hex digits): a signed token is still no place for a novel.
_MAX_JTI = 128
#: Bounds on the ``channels`` claim: a key has at most 100 patterns, each a channel name's size
#: at most (3 components and 2 slashes; 3 * 255 + 2 is looser than today's 191, on purpose).
MAX_CHANNEL_PATTERNS = 100
_MAX_PATTERN_CHARS = 3 * 255 + 2
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_JWT_SHAPE = re.compile(r"[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*")
# Verified signatures are remembered (never the time checks): Ed25519 verification is the
# costliest step of a JWT-authenticated request, and a token is typically reused many times.
_CACHE_SIZE = 4096

_log = logging.getLogger("static.auth")


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def is_uuid(text: str) -> bool:
    """Whether ``text`` is a UUID in canonical lower-case form."""
    return _UUID.fullmatch(text) is not None


def looks_like_jwt(text: str) -> bool:
    """Whether ``text`` has the three-part shape of a compact JWS."""
    return _JWT_SHAPE.fullmatch(text) is not None


@dataclass(frozen=True, slots=True)
class SigningKey:
    """An Ed25519 key pair and its key id."""

    kid: str
    private_key: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> SigningKey:
        return cls.from_private_key(Ed25519PrivateKey.generate())

    @classmethod
    def from_private_key(cls, private_key: Ed25519PrivateKey) -> SigningKey:
        public = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        # RFC 7638 thumbprint: SHA-256 of the required members, sorted, no whitespace.
        members = json.dumps(
            {"crv": "Ed25519", "kty": "OKP", "x": _b64url(public)},
            separators=(",", ":"),
            sort_keys=True,
        )
        return cls(_b64url(hashlib.sha256(members.encode()).digest()), private_key)

    @classmethod
    def from_pem(cls, pem: str) -> SigningKey:
        key = serialization.load_pem_private_key(pem.encode("ascii"), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError("the stored signing key is not an Ed25519 key")
        return cls.from_private_key(key)

    def to_pem(self) -> str:
        return self.private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ).decode("ascii")

    @property
    def public_key(self) -> Ed25519PublicKey:
        return self.private_key.public_key()

    def public_jwk(self) -> dict[str, str]:
        raw = self.public_key.public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        return {
            "kty": "OKP",
            "crv": "Ed25519",
            "x": _b64url(raw),
            "kid": self.kid,
            "alg": ALGORITHM,
            "use": "sig",
        }


@dataclass(frozen=True, slots=True)
class TokenRules:
    """Who issues tokens, for whom, and for how long."""

    issuer: str
    audience: str
    ttl_seconds: int
    #: Clock skew tolerated on ``exp``/``nbf``/``iat``, in seconds.
    leeway_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class TokenClaims:
    """What a verified token says."""

    account_id: str
    key_id: str
    issued_at: int
    expires_at: int
    token_id: str
    #: The key's channel patterns; None: every channel.
    channels: tuple[str, ...] | None = None


def mint_token(
    key: SigningKey,
    rules: TokenRules,
    *,
    account_id: str,
    key_id: str,
    now: float,
    not_after: int | None = None,
    channels: Sequence[str] | None = None,
) -> str:
    """A signed token for ``account_id``, minted from API key ``key_id``, valid from ``now``,
    never past ``not_after`` (the key's own end), limited to ``channels`` when given."""
    issued = math.floor(now)
    expires = issued + rules.ttl_seconds
    if not_after is not None:
        expires = min(expires, not_after)
    claims: dict[str, Any] = {
        "iss": rules.issuer,
        "sub": account_id,
        "aud": rules.audience,
        "iat": issued,
        "nbf": issued,
        # Exactly the configured lifetime after ``iat`` (a ceil here made it 901 s for 900).
        # Whole seconds, so the token may end up to 1 s before now + ``expires_in``: clients
        # refresh with a margin far larger (the SDK: min(30 s, a tenth of it)).
        "exp": expires,
        "jti": uuid.uuid4().hex,
        "key_id": key_id,
    }
    if channels is not None:
        claims["channels"] = list(channels)
    return jwt.encode(
        claims, key.private_key, algorithm=ALGORITHM, headers={"kid": key.kid, "typ": "JWT"}
    )


class TokenVerifierCore:
    """Verifies tokens against a set of public keys (signature, ``kid``, claims)."""

    def __init__(self, keys: Iterable[SigningKey], rules: TokenRules) -> None:
        self._keys: dict[str, Ed25519PublicKey] = {k.kid: k.public_key for k in keys}
        self._rules = rules
        self._jwt = jwt.PyJWT()
        self._verified: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def verify(self, token: str) -> TokenClaims:
        """The claims of ``token``; :class:`Unauthenticated` if it is not valid right now.

        Whatever else goes wrong while checking (a bug, a claim of a shape nobody foresaw) is
        also :class:`Unauthenticated`, logged once: a token costs at most its own request.
        """
        try:
            return self._verify(token)
        except Unauthenticated:
            raise
        except Exception as exc:  # every failure refuses this token only
            kid, sub = _unverified_ids(token)
            _log.warning(
                "token refused after an unexpected %s in its verification (kid %s, sub %s)",
                type(exc).__name__,
                kid,
                sub,
            )
            raise Unauthenticated(INVALID_TOKEN) from exc

    def _verify(self, token: str) -> TokenClaims:
        payload = self._verified.get(token)
        if payload is None:
            payload = self._verify_signature(token)
            self._verified[token] = payload
            if len(self._verified) > _CACHE_SIZE:
                self._verified.popitem(last=False)
        # pyjwt checked these on first sight; they are re-checked on every use because a
        # cached token expires like any other.
        now = time.time()
        leeway = self._rules.leeway_seconds
        if not payload["nbf"] - leeway <= now < payload["exp"] + leeway:
            raise Unauthenticated(INVALID_TOKEN)
        return TokenClaims(
            account_id=payload["sub"],
            key_id=payload["key_id"],
            issued_at=payload["iat"],
            expires_at=payload["exp"],
            token_id=payload["jti"],
            channels=None if "channels" not in payload else tuple(payload["channels"]),
        )

    def _verify_signature(self, token: str) -> dict[str, Any]:
        if not looks_like_jwt(token):
            raise Unauthenticated(INVALID_TOKEN)
        try:
            header = jwt.get_unverified_header(token)
            # Only our algorithm: no "none", no HMAC keyed with a public key, no downgrade.
            if header.get("alg") != ALGORITHM:
                raise Unauthenticated(INVALID_TOKEN)
            public = self._keys.get(header.get("kid"))  # type: ignore[arg-type]
            if public is None:
                raise Unauthenticated(INVALID_TOKEN)
            payload: dict[str, Any] = self._jwt.decode(
                token,
                public,
                algorithms=[ALGORITHM],
                audience=self._rules.audience,
                issuer=self._rules.issuer,
                leeway=self._rules.leeway_seconds,
                options={"require": _REQUIRED},
            )
        except (jwt.InvalidTokenError, TypeError, ValueError) as exc:
            raise Unauthenticated(INVALID_TOKEN) from exc
        if not _claims_well_typed(payload):
            raise Unauthenticated(INVALID_TOKEN)
        return payload


def _claims_well_typed(payload: Any) -> bool:
    """Whether every claim we read has exactly the type we mint it with.

    pyjwt is lenient where we must not be: it accepts ``"exp": "99999999999"`` (``int()`` of a
    numeric string), ``true`` as 1, floats, and a list for ``aud``; our own checks would then
    compare a string with a float. A lifetime (``exp - iat``) over ``MAX_TOKEN_TTL_SECONDS`` is
    refused too: none is minted, and pyjwt has checked that ``iat`` is not in the future, so
    ``exp`` stays within a day from now. Checked once per token (cached with its signature).
    """
    if not isinstance(payload, dict):
        return False
    for name in _TIMES:
        value = payload.get(name)
        # ``type() is int``: a bool is an int to isinstance.
        if type(value) is not int:
            return False
    # An ``exp`` of 1e20 overflowed the relay's clock arithmetic (a panic in the extension,
    # INTERNAL to the caller): a lifetime no server mints is refused here.
    if not 0 < payload["exp"] - payload["iat"] <= MAX_TOKEN_TTL_SECONDS:
        return False
    if "channels" in payload:
        channels = payload["channels"]
        # Present only when the key is limited: a non-empty list of bounded strings.
        if (
            type(channels) is not list
            or not 0 < len(channels) <= MAX_CHANNEL_PATTERNS
            or not all(type(c) is str and 0 < len(c) <= _MAX_PATTERN_CHARS for c in channels)
        ):
            return False
    jti = payload.get("jti")
    return (
        type(payload.get("iss")) is str
        and type(payload.get("aud")) is str
        and isinstance(jti, str)
        and 0 < len(jti) <= _MAX_JTI
        and all(
            type(payload.get(name)) is str and _UUID.fullmatch(payload[name]) is not None
            for name in ("sub", "key_id")
        )
    )


def _unverified_ids(token: str) -> tuple[str, str]:
    """The ``kid`` and ``sub`` a token claims (unverified, shortened), for a log line: never the
    token itself."""
    kid = sub = "?"
    try:
        kid = repr(jwt.get_unverified_header(token).get("kid"))[:64]
        claims = jwt.decode(token, options={"verify_signature": False})
        sub = repr(claims.get("sub"))[:64]
    except Exception:  # noqa: BLE001  (a log line's detail; the refusal stands anyway)
        pass
    return kid, sub
