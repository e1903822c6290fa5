"""The auth-failure limiter's attempts (pure): a check pays for its failure before it starts,
and gets it back when the credential works or the store could not answer."""

from __future__ import annotations

from static._settings import RateLimit
from static.api._ratelimit import AuthAttempt, AuthFailureLimiter

GOOD, OTHER = b"g" * 32, b"o" * 32


def guess(n: int) -> bytes:
    return n.to_bytes(32, "big")


def test_checks_in_flight_together_cannot_outrun_the_budget() -> None:
    limiter = AuthFailureLimiter(RateLimit(3, 30))  # 3, then one every 10 s
    # Five checks start before any ends: only three may go on, whatever their outcome.
    started = [limiter.attempt("10.0.0.1", guess(n), 0.0) for n in range(5)]
    assert [type(a) for a in started] == [AuthAttempt] * 3 + [int, int]
    assert started[3] == 10
    for attempt in started[:3]:
        assert isinstance(attempt, AuthAttempt)
        attempt.failed(0.0)
    assert limiter.attempt("10.0.0.1", guess(9), 0.0) == 10
    assert limiter.attempt("10.0.0.1", None, 0.0) == 10  # no credential at all
    assert isinstance(limiter.attempt("10.0.0.2", guess(9), 0.0), AuthAttempt)  # its own budget
    assert isinstance(limiter.attempt("10.0.0.1", guess(9), 10.0), AuthAttempt)  # refilled


def test_a_credential_that_works_gets_its_token_back_and_passes_from_then_on() -> None:
    limiter = AuthFailureLimiter(RateLimit(2, 60))
    good = limiter.attempt("a", GOOD, 0.0)
    guessed = limiter.attempt("a", guess(1), 0.0)
    assert isinstance(good, AuthAttempt) and isinstance(guessed, AuthAttempt)
    assert limiter.attempt("a", guess(2), 0.0) == 30  # both tokens held by checks in flight
    good.succeeded(0.0)
    guessed.failed(0.0)
    # The success gave its token back: one more guess, then none.
    last = limiter.attempt("a", guess(3), 0.0)
    assert isinstance(last, AuthAttempt)
    last.failed(0.0)
    assert limiter.attempt("a", guess(4), 0.0) == 30
    # The credential that worked passes an empty bucket, and pays nothing.
    for _ in range(5):
        known = limiter.attempt("a", GOOD, 0.0)
        assert isinstance(known, AuthAttempt)
        known.succeeded(0.0)
    assert limiter.attempt("a", OTHER, 0.0) == 30
    assert isinstance(limiter.attempt("b", GOOD, 0.0), AuthAttempt)  # another address: its own


def test_a_known_credential_that_fails_pays_and_is_no_longer_exempt() -> None:
    limiter = AuthFailureLimiter(RateLimit(2, 60))
    limiter.succeeded("a", GOOD)
    revoked = limiter.attempt("a", GOOD, 0.0)
    assert isinstance(revoked, AuthAttempt)
    revoked.failed(0.0)  # say, its key was revoked since
    assert limiter.wait("a", OTHER, 0.0) is None  # one token left
    again = limiter.attempt("a", GOOD, 0.0)
    assert isinstance(again, AuthAttempt)
    again.failed(0.0)
    assert limiter.attempt("a", GOOD, 0.0) == 30


def test_an_undecided_check_costs_nothing_and_an_unsettled_one_keeps_its_token() -> None:
    limiter = AuthFailureLimiter(RateLimit(1, 60))
    unavailable = limiter.attempt("a", guess(1), 0.0)
    assert isinstance(unavailable, AuthAttempt)
    unavailable.abandoned(0.0)  # the store could not answer (a 503)
    cancelled = limiter.attempt("a", guess(2), 0.0)
    assert isinstance(cancelled, AuthAttempt)
    # The client went away mid-check: nothing settles it, and the token stays spent.
    assert limiter.attempt("a", guess(3), 0.0) == 60
    # A refund never lifts a bucket past its capacity.
    limiter = AuthFailureLimiter(RateLimit(1, 60))
    first = limiter.attempt("a", guess(1), 0.0)
    assert isinstance(first, AuthAttempt)
    first.succeeded(120.0)  # refilled meanwhile
    assert isinstance(limiter.attempt("a", guess(2), 120.0), AuthAttempt)
    assert limiter.attempt("a", guess(3), 120.0) == 60
