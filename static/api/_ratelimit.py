"""Token-bucket rate limiting (pure; the caller passes the clock).

One bucket per key (a client address or an API key id). Memory is bounded: past ``max_keys``
buckets, the full ones (idle clients) are dropped first, then the oldest, down to 90% so that
the sweep runs once per many new keys rather than on each.

:class:`AuthFailureLimiter` spends the same buckets on failed authentications per client
address, and remembers which credentials recently succeeded from each address, so that a good
client sharing an address with a guesser keeps working (docs/design.md, "Failed
authentications").
"""

from __future__ import annotations

import ipaddress
import math
from collections import OrderedDict

from static._settings import RateLimit

__all__ = ["AuthFailureLimiter", "RateLimiter", "client_key"]


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
        tokens = self._tokens(key, now)
        if tokens < 1.0:
            self._buckets[key] = (tokens, now)
            return self._wait(tokens)
        if key not in self._buckets and len(self._buckets) >= self._max_keys:
            self._evict(now)
        self._buckets[key] = (tokens - 1.0, now)
        return None

    def wait(self, key: str, now: float) -> int | None:
        """Like :meth:`acquire` without taking a token: None when one is left for ``key``."""
        tokens = self._tokens(key, now)
        return self._wait(tokens) if tokens < 1.0 else None

    def _tokens(self, key: str, now: float) -> float:
        tokens, then = self._buckets.get(key, (self._capacity, now))
        return min(self._capacity, tokens + (now - then) * self._rate)

    def _wait(self, tokens: float) -> int:
        return max(1, math.ceil((1.0 - tokens) / self._rate))

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


class AuthFailureLimiter:
    """Failed authentications per client address (``limit``, one :class:`RateLimiter`), and
    the credentials that succeeded lately from each address.

    An address whose failures spent its bucket is refused (429) before its credential is even
    looked at, except for a credential that succeeded from that same address among the last
    ``max_known`` successes: a good client behind the same NAT as a guesser keeps working, and
    the guesser cannot join it without a credential that works. The caller passes digests of
    credentials, never the credentials.
    """

    def __init__(
        self, limit: RateLimit, *, max_addresses: int = 100_000, max_known: int = 50_000
    ) -> None:
        self._failures = RateLimiter(limit, max_keys=max_addresses)
        self._max_known = max_known
        # (address key, credential digest), least recently successful first.
        self._known: OrderedDict[tuple[str, bytes], None] = OrderedDict()

    def wait(self, address: str, credential: bytes | None, now: float) -> int | None:
        """None to go on and check ``credential`` (a digest) from ``address``; else the seconds
        to wait before trying again."""
        if credential is not None and (address, credential) in self._known:
            return None
        return self._failures.wait(address, now)

    def failed(self, address: str, now: float) -> None:
        """Count a failed authentication from ``address``."""
        self._failures.acquire(address, now)

    def succeeded(self, address: str, credential: bytes) -> None:
        """Remember that ``credential`` (a digest) works from ``address``."""
        self._known[(address, credential)] = None
        self._known.move_to_end((address, credential))
        while len(self._known) > self._max_known:
            self._known.popitem(last=False)
