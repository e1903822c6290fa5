"""Caps on the HTTP API's connections, overall and per client address (docs/design.md §4).

hypercorn (0.18.0) accepts every connection its listener gets and serves each in a task of its
own. The cap is checked first thing in that task (``_serve.py`` wraps ``TCPServer.run``): a
connection over it is closed at once, before any HTTP is read or any protocol state is made,
and counted; a line goes to the log at most every :data:`LOG_EVERY_SECONDS`. Measured at
e879e1d: without caps, 20,000 idle connections took every file descriptor of the process, and
``/healthz`` and the relay stopped answering.
"""

from __future__ import annotations

import logging
import time

from static.api._ratelimit import client_key

__all__ = ["LOG_EVERY_SECONDS", "ConnectionCaps"]

_log = logging.getLogger("static.api")

#: At most one log line about refused connections per this many seconds.
LOG_EVERY_SECONDS = 10.0


class ConnectionCaps:
    """Connections served at once: at most ``max_total``, and ``max_per_address`` per client
    address (an IPv6 client's /64, as the rate limits count it)."""

    def __init__(self, max_total: int, max_per_address: int) -> None:
        self.max_total = max_total
        self.max_per_address = max_per_address
        self._total = 0
        self._per_address: dict[str, int] = {}
        self._refused = 0
        self._logged_at: float | None = None

    def admit(self, address: str) -> str | None:
        """A place for a connection from ``address``: its key, to give back with
        :meth:`release`; None when a cap is reached (the refusal is counted and logged,
        rate-limited)."""
        key = client_key(address)
        held = self._per_address.get(key, 0)
        if self._total >= self.max_total or held >= self.max_per_address:
            self._refuse(key)
            return None
        self._per_address[key] = held + 1
        self._total += 1
        return key

    def release(self, key: str) -> None:
        """Give back the place :meth:`admit` gave under ``key``."""
        self._total -= 1
        held = self._per_address.pop(key, 0) - 1
        if held > 0:
            self._per_address[key] = held

    def _refuse(self, key: str) -> None:
        self._refused += 1
        now = time.monotonic()
        if self._logged_at is not None and now - self._logged_at < LOG_EVERY_SECONDS:
            return
        _log.warning(
            "refused %d connection(s) over the caps (%d connections, %d per address), "
            "the last from %s",
            self._refused,
            self.max_total,
            self.max_per_address,
            key,
        )
        self._logged_at = now
        self._refused = 0
