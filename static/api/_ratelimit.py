"""Token-bucket rate limiting (pure; the caller passes the clock).

One bucket per key (a client address or an API key id). Memory is bounded: past ``max_keys``
buckets, the full ones (idle clients) are dropped first, then the oldest, down to 90% so that
the sweep runs once per many new keys rather than on each.

:class:`AuthFailureLimiter` spends the same buckets on failed authentications per client
address, and remembers which credentials recently succeeded from each address, so that a good
client sharing an address with a guesser keeps working (docs/design.md, "Failed
authentications"). Each check pays for its failure before it starts (:class:`AuthAttempt`), so
that checks running at once cannot all pass a bucket that holds fewer tokens than them.
"""

from __future__ import annotations

import ipaddress
import math
from collections import OrderedDict

from static._settings import RateLimit

__all__ = ["AuthAttempt", "AuthFailureLimiter", "RateLimiter", "client_key"]


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

    def refund(self, key: str, now: float) -> None:
        """Give back a token that :meth:`acquire` took for ``key`` (never past the capacity; a
        bucket evicted meanwhile is full already)."""
        if key in self._buckets:
            self._buckets[key] = (min(self._capacity, self._tokens(key, now) + 1.0), now)

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

    def attempt(self, address: str, credential: bytes | None, now: float) -> AuthAttempt | int:
        """Start checking ``credential`` (a digest; None when the request carries none) from
        ``address``: the :class:`AuthAttempt` to settle with the check's outcome, or the seconds
        to wait when the address has no failure left.

        The failure is paid here, before the check awaits anything, and given back if the
        credential works. Checked first and counted after the await, 128 guessers at once got
        2,285 answers of 401 against a budget of 100 (issue 27): they all passed the check while
        the others' lookups were in flight. A credential that worked from ``address`` lately pays
        nothing."""
        if credential is not None and (address, credential) in self._known:
            return AuthAttempt(self, address, credential, paid=False)
        wait = self._failures.acquire(address, now)
        if wait is not None:
            return wait
        return AuthAttempt(self, address, credential, paid=True)

    def wait(self, address: str, credential: bytes | None, now: float) -> int | None:
        """None when ``credential`` (a digest) from ``address`` would be checked now; else the
        seconds to wait. Takes nothing: :meth:`attempt` is what the ports use."""
        if credential is not None and (address, credential) in self._known:
            return None
        return self._failures.wait(address, now)

    def failed(self, address: str, now: float) -> None:
        """Count a failed authentication from ``address`` (one not paid by an attempt)."""
        self._failures.acquire(address, now)

    def succeeded(self, address: str, credential: bytes) -> None:
        """Remember that ``credential`` (a digest) works from ``address``."""
        self._known[(address, credential)] = None
        self._known.move_to_end((address, credential))
        while len(self._known) > self._max_known:
            self._known.popitem(last=False)

    def _forget(self, address: str, credential: bytes) -> None:
        self._known.pop((address, credential), None)

    def _refund(self, address: str, now: float) -> None:
        self._failures.refund(address, now)


class AuthAttempt:
    """One credential's check from one address, its failure paid in advance (or nothing paid,
    for a credential that worked from there lately). Settle it once: :meth:`succeeded`,
    :meth:`failed`, or :meth:`abandoned`; an attempt left unsettled (a cancelled request) keeps
    what it paid."""

    __slots__ = ("_address", "_credential", "_limiter", "_paid")

    def __init__(
        self, limiter: AuthFailureLimiter, address: str, credential: bytes | None, *, paid: bool
    ) -> None:
        self._limiter = limiter
        self._address = address
        self._credential = credential
        self._paid = paid

    def succeeded(self, now: float) -> None:
        """The credential works: its failure is given back, and it passes from now on."""
        if self._credential is not None:
            self._limiter.succeeded(self._address, self._credential)
        self._settle_refunding(now)

    def failed(self, now: float) -> None:
        """The credential was refused (a 401, UNAUTHENTICATED): the failure stays spent. A
        credential that used to work pays now, and is no longer exempt."""
        if not self._paid:
            if self._credential is not None:
                self._limiter._forget(self._address, self._credential)
            self._limiter.failed(self._address, now)
        self._paid = False

    def abandoned(self, now: float) -> None:
        """The check could not decide (the store was unavailable): nothing is counted."""
        self._settle_refunding(now)

    def _settle_refunding(self, now: float) -> None:
        if self._paid:
            self._limiter._refund(self._address, now)
        self._paid = False
