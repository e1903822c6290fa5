"""Authentication: API keys, JWTs, and the principal a request acts for.

The pure rules (key format, JWT minting and verification) live in ``_keys`` and ``_tokens``;
:class:`Authority` applies them over the store and is the concrete :class:`TokenVerifier`.
"""

from static.auth._authority import (
    INVALID_KEY,
    KEY_EXPIRED,
    Authority,
    IssuedToken,
    open_authority,
)
from static.auth._keys import KEY_PREFIX, GeneratedKey, generate_api_key, hash_api_key, is_api_key
from static.auth._principal import Principal, TokenVerifier, Unauthenticated
from static.auth._tokens import (
    INVALID_TOKEN,
    SigningKey,
    TokenClaims,
    TokenRules,
    is_uuid,
    looks_like_jwt,
    mint_token,
)

__all__ = [
    "INVALID_KEY",
    "INVALID_TOKEN",
    "KEY_EXPIRED",
    "KEY_PREFIX",
    "Authority",
    "GeneratedKey",
    "IssuedToken",
    "Principal",
    "SigningKey",
    "TokenClaims",
    "TokenRules",
    "TokenVerifier",
    "Unauthenticated",
    "generate_api_key",
    "hash_api_key",
    "is_api_key",
    "is_uuid",
    "looks_like_jwt",
    "mint_token",
    "open_authority",
]
