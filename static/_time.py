"""Times as the HTTP API writes them: ISO 8601 UTC with a ``Z``, to the microsecond."""

from __future__ import annotations

from datetime import UTC, datetime

__all__ = ["iso_utc", "iso_utc_ms"]

_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"


def iso_utc(value: datetime) -> str:
    """``value`` (aware) as the API writes times."""
    return value.astimezone(UTC).strftime(_FORMAT)


def iso_utc_ms(ms: int) -> str:
    """``ms`` since the epoch as the API writes times."""
    return datetime.fromtimestamp(ms / 1000, UTC).strftime(_FORMAT)
