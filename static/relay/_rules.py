"""Pure rules of the relay: the epoch fence, idempotency keys, rate limits, header checks."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from static.relay._errors import InvalidArgument, StaleEpoch, Unauthenticated
from static.relay._framing import ContentType, MessageHeader

__all__ = ["TokenBucket", "bearer_token", "check_fence", "epoch_after", "idempotency_key"]

MAX_IDEMPOTENCY_KEY = 64
_MAX_HEADER = 8192
# RFC 7230 field-value: visible ASCII and spaces/tabs. h2 3.2.0 does not check this
# (CVE-2025-57804), so the relay checks every header value it reads.
_FIELD_VALUE = re.compile(r"[\x20-\x7e\t]*")
_BEARER = re.compile(r"Bearer ([A-Za-z0-9\-_.~+/]+=*)", re.IGNORECASE)


def check_fence(header: MessageHeader, channel_epoch: int, application_window: int) -> None:
    """Raise :class:`StaleEpoch` unless ``header`` may be appended at ``channel_epoch``.

    Commits and proposals need the current epoch; application messages the current epoch or one
    of the ``application_window`` before it.
    """
    if header.content_type is ContentType.APPLICATION:
        if channel_epoch - application_window <= header.epoch <= channel_epoch:
            return
    elif header.epoch == channel_epoch:
        return
    raise StaleEpoch(header.epoch, channel_epoch)


def epoch_after(header: MessageHeader, channel_epoch: int) -> int:
    """The channel's epoch once ``header`` (already fenced) is appended."""
    return channel_epoch + 1 if header.content_type is ContentType.COMMIT else channel_epoch


def idempotency_key(given: bytes, message: bytes) -> bytes:
    """The key that makes a publish idempotent: the client's, or SHA-256 of the message."""
    if not given:
        return hashlib.sha256(message).digest()
    if len(given) > MAX_IDEMPOTENCY_KEY:
        raise InvalidArgument(f"idempotency_key longer than {MAX_IDEMPOTENCY_KEY} bytes")
    # A distinct prefix keeps client keys from ever equalling a digest-derived key.
    return b"k:" + given


def bearer_token(metadata: tuple[tuple[str, str | bytes], ...]) -> str | None:
    """The token of the ``authorization`` metadata, None when absent; checks the header value."""
    values = [value for name, value in metadata if name.lower() == "authorization"]
    if not values:
        return None
    if len(values) > 1:
        raise Unauthenticated("more than one authorization header")
    value = values[0]
    if not isinstance(value, str) or len(value) > _MAX_HEADER:
        raise Unauthenticated("malformed authorization header")
    if _FIELD_VALUE.fullmatch(value) is None:
        raise Unauthenticated("illegal characters in the authorization header")
    match = _BEARER.fullmatch(value.strip())
    if match is None:
        raise Unauthenticated("expected 'authorization: Bearer <token>'")
    return match[1]


@dataclass(slots=True)
class TokenBucket:
    """``rate`` tokens a second, at most ``burst`` saved up."""

    rate: float
    burst: float
    tokens: float
    updated: float

    @classmethod
    def full(cls, rate: float, burst: float, now: float) -> TokenBucket:
        return cls(rate, burst, burst, now)

    def take(self, now: float, n: float = 1.0) -> float:
        """Take ``n`` tokens; return 0.0 on success, else the seconds until they would be there."""
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens >= n:
            self.tokens -= n
            return 0.0
        return (n - self.tokens) / self.rate if self.rate > 0 else float("inf")
