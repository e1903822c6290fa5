"""Token-bucket rate limiting (pure; the caller passes the clock).

One bucket per key (a client address or an API key id). Memory is bounded: past ``max_keys``
buckets, the full ones (idle clients) are dropped first, then the oldest, down to 90% so that
the sweep runs once per many new keys rather than on each.
"""

from __future__ import annotations

import ipaddress
import math

from static._settings import RateLimit

__all__ = ["RateLimiter", "client_key"]


def client_key(address: str) -> str:
    """The rate-limit key of a client address: the address itself, but the /64 for IPv6 (one
    subscriber typically holds a whole /64, so single addresses would be free to rotate)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


class RateLimiter:
    """Up to ``limit.requests`` at once per key, refilled at ``requests / per_seconds`` a second."""

    def __init__(self, limit: RateLimit, *, max_keys: int = 100_000) -> None:
        self._capacity = float(limit.requests)
        self._rate = limit.requests / limit.per_seconds
        self._max_keys = max_keys
        # key -> (tokens left, time of that count); dicts keep insertion order (oldest first).
        self._buckets: dict[str, tuple[float, float]] = {}

    def acquire(self, key: str, now: float) -> int | None:
        """Take one token for ``key``: None when allowed, else the seconds to wait (>= 1)."""
        tokens, then = self._buckets.get(key, (self._capacity, now))
        tokens = min(self._capacity, tokens + (now - then) * self._rate)
        if tokens < 1.0:
            self._buckets[key] = (tokens, now)
            return max(1, math.ceil((1.0 - tokens) / self._rate))
        if key not in self._buckets and len(self._buckets) >= self._max_keys:
            self._evict(now)
        self._buckets[key] = (tokens - 1.0, now)
        return None

    def _evict(self, now: float) -> None:
        full = [
            key
            for key, (tokens, then) in self._buckets.items()
            if tokens + (now - then) * self._rate >= self._capacity
        ]
        for key in full:
            del self._buckets[key]
        target = self._max_keys * 9 // 10
        while len(self._buckets) > target:
            del self._buckets[next(iter(self._buckets))]
