"""API key secrets: format, generation and digest (pure; no I/O).

A secret is ``sk_live_`` followed by 32 random bytes in base62, always 43 characters (256 bits).
Only its SHA-256 digest is stored; a lookup is an indexed equality match on the digest, so no
per-key salt (the secret's entropy already defeats precomputation).
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass

__all__ = ["KEY_PREFIX", "GeneratedKey", "generate_api_key", "hash_api_key", "is_api_key"]

KEY_PREFIX = "sk_live_"
_ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_RANDOM_BYTES = 32
_RANDOM_CHARS = 43  # ceil(256 / log2(62))
_SHOWN_CHARS = 8
_SHAPE = re.compile(rf"{KEY_PREFIX}[0-9A-Za-z]{{{_RANDOM_CHARS}}}")


@dataclass(frozen=True, slots=True)
class GeneratedKey:
    """A fresh secret, its digest, and the prefix that is safe to display."""

    secret: str
    digest: bytes
    key_prefix: str


def _base62(data: bytes, width: int) -> str:
    number = int.from_bytes(data, "big")
    chars = []
    while number:
        number, digit = divmod(number, 62)
        chars.append(_ALPHABET[digit])
    return "".join(reversed(chars)).rjust(width, _ALPHABET[0])


def generate_api_key() -> GeneratedKey:
    """A new random secret."""
    secret = KEY_PREFIX + _base62(secrets.token_bytes(_RANDOM_BYTES), _RANDOM_CHARS)
    return GeneratedKey(
        secret=secret,
        digest=hash_api_key(secret),
        key_prefix=secret[: len(KEY_PREFIX) + _SHOWN_CHARS],
    )


def hash_api_key(secret: str) -> bytes:
    """The SHA-256 digest under which ``secret`` is stored."""
    return hashlib.sha256(secret.encode("utf-8")).digest()


def is_api_key(text: str) -> bool:
    """Whether ``text`` has the shape of a secret (so anything else needs no database lookup)."""
    return _SHAPE.fullmatch(text) is not None
