"""The relay reads of the HTTP API (``GET /v1/channels``, ``GET /v1/channels/rate``): their query
rules, the relay they read (:class:`RelayReads`, the relay of the same process) and the JSON they
answer.

Who may call them: an API key with the ``channels`` scope; the answer holds only channels in
which the key's account has a bound leaf, and only those matching the key's channel patterns.
What one call costs is the relay's to bound (``crates/relay/src/overview.rs``): a page reads at
most :data:`MAX_CHANNELS_LIMIT` channel rows and loads their group states (at most 100 members
each are returned); the rate counts the account's application messages of the last hour
through an index. Both run on a worker thread, never on the event loop.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Final, Protocol

import trio

from static._time import iso_utc_ms
from static.api._errors import BadRequest, ServiceUnavailable
from static.api._observe import RelayStatus

__all__ = [
    "CHANNELS_CURSOR",
    "DEFAULT_CHANNELS_LIMIT",
    "MAX_CHANNELS_LIMIT",
    "RATE_MINUTES",
    "NativeChannel",
    "RelayReads",
    "channel_page",
    "message_rate",
    "parse_channels_query",
]

#: Channels per page, by default and at most (the relay caps it there too).
DEFAULT_CHANNELS_LIMIT: Final = 20
MAX_CHANNELS_LIMIT: Final = 50
#: Minutes the rate covers, the current one last (the relay's ``RATE_MINUTES``).
RATE_MINUTES: Final = 60
#: The cursor: the id of the last channel read (decimal).
CHANNELS_CURSOR: Final = "^[0-9]{1,18}$"

_NOT_RUNNING = "relay is not running"

#: One channel as the relay returns it (``static._native.relay.RelayServer.account_channels``).
NativeChannel = tuple[
    str,
    int,
    int,
    int | None,
    tuple[int | None, int | None, int | None],
    int,
    list[tuple[int, bytes, str | None]],
]


class RelayReads(RelayStatus, Protocol):
    """What the channel routes read of the relay (:class:`static.relay.RelayHandle`); both
    block (call them from a thread) and return None while the relay is not running."""

    def account_channels(
        self, account: str, patterns: list[str] | None, after: int, limit: int
    ) -> tuple[list[NativeChannel], int | None] | None: ...

    def account_rate(
        self, account: str, patterns: list[str] | None, now_ms: int
    ) -> list[int] | None: ...


def parse_channels_query(args: Any) -> tuple[int, int]:
    """``limit`` (1-50, default 20) and ``cursor`` (a previous page's ``next_cursor``) of GET
    /v1/channels from the query string (a werkzeug ``MultiDict``): (limit, after)."""
    limits = args.getlist("limit")
    cursors = args.getlist("cursor")
    if len(limits) > 1 or len(cursors) > 1:
        raise BadRequest("limit and cursor may each be given once")
    limit = DEFAULT_CHANNELS_LIMIT
    if limits:
        text = limits[0]
        if not (text.isascii() and text.isdigit() and len(text) <= 3) or not (
            1 <= int(text) <= MAX_CHANNELS_LIMIT
        ):
            raise BadRequest(f"limit must be an integer between 1 and {MAX_CHANNELS_LIMIT}")
        limit = int(text)
    after = 0
    if cursors:
        text = cursors[0]
        if not (text.isascii() and text.isdigit() and 1 <= len(text) <= 18):
            raise BadRequest("invalid cursor")
        after = int(text)
    return limit, after


def _timestamp_ms(ms: int | None) -> str | None:
    if ms is None:
        return None
    return iso_utc_ms(ms)


def _channel_json(channel: NativeChannel) -> dict[str, Any]:
    name, epoch, head_seq, last_ms, (max_age, max_entries, max_bytes), count, members = channel
    return {
        "name": name,
        "epoch": epoch,
        "messages": head_seq,
        "last_activity_at": _timestamp_ms(last_ms),
        "retention": {
            "max_age_seconds": max_age,
            "max_entries": max_entries,
            "max_bytes": max_bytes,
        },
        "member_count": count,
        "members": [
            {
                "leaf_index": leaf,
                # Identities are bytes the agent chose: text when they are UTF-8.
                "identity": bytes(identity).decode("utf-8", "replace"),
                "identity_hex": bytes(identity).hex(),
                "account": account,
                "bound": account is not None,
            }
            for leaf, identity, account in members
        ],
    }


async def channel_page(
    relay: RelayReads | None,
    account: str,
    patterns: tuple[str, ...] | None,
    limit: int,
    after: int,
) -> dict[str, Any]:
    """The body of GET /v1/channels: ``{"channels": [...], "next_cursor": str | None}``;
    503 while the relay is not running or its store cannot be read."""
    if relay is None:
        raise ServiceUnavailable(_NOT_RUNNING)
    wanted = None if patterns is None else list(patterns)
    try:
        page = await trio.to_thread.run_sync(relay.account_channels, account, wanted, after, limit)
    except OSError:
        raise ServiceUnavailable("the relay's store cannot be read") from None
    if page is None:
        raise ServiceUnavailable(_NOT_RUNNING)
    channels, next_after = page
    return {
        "channels": [_channel_json(c) for c in channels],
        "next_cursor": None if next_after is None else str(next_after),
    }


async def message_rate(
    relay: RelayReads | None, account: str, patterns: tuple[str, ...] | None
) -> dict[str, Any]:
    """The body of GET /v1/channels/rate: the account's application messages per minute over
    the last hour; 503 while the relay is not running or its store cannot be read."""
    if relay is None:
        raise ServiceUnavailable(_NOT_RUNNING)
    wanted = None if patterns is None else list(patterns)
    now_ms = int(datetime.now(UTC).timestamp() * 1000)
    try:
        rate = await trio.to_thread.run_sync(relay.account_rate, account, wanted, now_ms)
    except OSError:
        raise ServiceUnavailable("the relay's store cannot be read") from None
    if rate is None:
        raise ServiceUnavailable(_NOT_RUNNING)
    first_minute = now_ms // 60_000 - (len(rate) - 1)
    return {
        "start": _timestamp_ms(first_minute * 60_000),
        "minute_seconds": 60,
        "per_minute": rate,
        "total": sum(rate),
    }
