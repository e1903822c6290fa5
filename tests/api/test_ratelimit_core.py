"""The pure rate-limit core: token buckets, Retry-After, bounded memory, client keys."""

from __future__ import annotations

import pytest

from static._settings import RateLimit
from static.api._ratelimit import RateLimiter, client_key


def test_bucket_allows_a_burst_then_refills() -> None:
    limiter = RateLimiter(RateLimit(3, 30))  # bursts of 3, one token every 10 s
    assert [limiter.acquire("k", 0.0) for _ in range(3)] == [None, None, None]
    assert limiter.acquire("k", 0.0) == 10
    assert limiter.acquire("k", 4.0) == 6  # Retry-After counts down
    assert limiter.acquire("k", 10.0) is None
    assert limiter.acquire("k", 10.0) == 10
    assert limiter.acquire("other", 10.0) is None  # buckets are per key


def test_retry_after_is_at_least_one_second() -> None:
    limiter = RateLimiter(RateLimit(100, 1))
    for _ in range(100):
        assert limiter.acquire("k", 0.0) is None
    assert limiter.acquire("k", 0.0) == 1


def test_memory_is_bounded() -> None:
    limiter = RateLimiter(RateLimit(2, 60), max_keys=100)
    for i in range(10_000):
        limiter.acquire(str(i), float(i) / 1000)
    assert len(limiter._buckets) <= 100
    # The most recent clients are still limited.
    limiter.acquire("9999", 10.0)
    assert limiter.acquire("9999", 10.0) is not None


@pytest.mark.parametrize(
    ("address", "key"),
    [
        ("127.0.0.1", "127.0.0.1"),
        ("2001:db8::1", "2001:db8::/64"),
        ("2001:db8::ffff:1", "2001:db8::/64"),
        ("2001:db8:0:1::1", "2001:db8:0:1::/64"),
        ("::ffff:10.0.0.1", "10.0.0.1"),
        ("", ""),
    ],
)
def test_client_keys(address: str, key: str) -> None:
    assert client_key(address) == key
