"""The pure rate-limit core: token buckets, Retry-After, bounded memory, client keys."""

from __future__ import annotations

import pytest

from static._settings import RateLimit
from static.api._ratelimit import AuthFailureLimiter, RateLimiter, client_key


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


def test_auth_failures_spend_the_address_budget_but_known_credentials_pass() -> None:
    limiter = AuthFailureLimiter(RateLimit(3, 30))
    good, guess = b"g" * 32, b"x" * 32
    limiter.succeeded("10.0.0.1", good)
    for _ in range(3):
        assert limiter.wait("10.0.0.1", guess, 0.0) is None
        limiter.failed("10.0.0.1", 0.0)
    assert limiter.wait("10.0.0.1", guess, 0.0) == 10
    assert limiter.wait("10.0.0.1", None, 0.0) == 10  # no credential at all
    # The credential that worked from there still does; not from another address.
    assert limiter.wait("10.0.0.1", good, 0.0) is None
    limiter.failed("10.0.0.2", 0.0)
    assert limiter.wait("10.0.0.2", good, 0.0) is None  # another address, its own budget
    assert limiter.wait("10.0.0.1", guess, 10.0) is None  # refilled


def test_auth_failure_memory_is_bounded() -> None:
    limiter = AuthFailureLimiter(RateLimit(1, 60), max_addresses=100, max_known=50)
    for i in range(10_000):
        limiter.failed(f"a{i}", 0.0)
        limiter.succeeded(f"a{i}", b"c")
    assert len(limiter._known) == 50
    assert len(limiter._failures._buckets) <= 100
    # The most recent successes are the ones kept.
    assert limiter.wait("a9999", b"c", 0.0) is None
    assert limiter.wait("a0", b"c", 0.0) is None  # evicted: a fresh bucket, not refused
