"""``RelayHandle``: what the HTTP port reads of the relay in the same process (``/readyz``,
``/metrics``), filled in by :func:`~static.relay.serve_relay` once the relay listens."""

from __future__ import annotations

from static._native.relay import RelayServer

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
