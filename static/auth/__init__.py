"""Authentication: API keys, JWTs, and the principal a request acts for."""

from static.auth._principal import Principal, TokenVerifier, Unauthenticated

__all__ = ["Principal", "TokenVerifier", "Unauthenticated"]
