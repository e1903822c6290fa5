"""``RelayHandle``: what the HTTP port reads of the relay in the same process (``/readyz``,
``/metrics``, ``/v1/channels``), filled in by :func:`~static.relay.serve_relay` once the relay
listens."""

from __future__ import annotations

from static._native.relay import RelayServer
from static.api import NativeChannel

__all__ = ["RelayHandle"]


class RelayHandle:
    """The running relay's health and metrics; "not running" until it listens, and again once
    it stopped (its ``RelayServer`` answers so after ``shutdown``)."""

    def __init__(self) -> None:
        self._server: RelayServer | None = None

    def attach(self, server: RelayServer) -> None:
        self._server = server

    def not_ready(self) -> str | None:
        """None while the relay serves and its store can write, else why not."""
        if self._server is None:
            return "relay is not running"
        return self._server.health()

    def metrics_text(self) -> str:
        """The relay's metrics (Prometheus text), empty while it is not running."""
        return "" if self._server is None else self._server.metrics()

    def account_channels(
        self, account: str, patterns: list[str] | None, after: int, limit: int
    ) -> tuple[list[NativeChannel], int | None] | None:
        """A page of ``account``'s channels (``RelayServer.account_channels``), None while the
        relay is not running. Blocks: call it from a thread."""
        if self._server is None:
            return None
        return self._server.account_channels(account, patterns, after, limit)

    def account_rate(
        self, account: str, patterns: list[str] | None, now_ms: int
    ) -> list[int] | None:
        """``account``'s messages per minute over the last hour (``RelayServer.account_rate``),
        None while the relay is not running. Blocks: call it from a thread."""
        if self._server is None:
            return None
        return self._server.account_rate(account, patterns, now_ms)
