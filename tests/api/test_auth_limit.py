"""Failed authentications per client address: 429 with Retry-After past the budget, on every
route that authenticates, and RESOURCE_EXHAUSTED on the relay; credentials that worked from the
address keep working."""

from __future__ import annotations

import http.client
import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from urllib.parse import urlsplit

import grpc
import httpx
import pytest

from static.auth import generate_api_key
from tests.relay.client import Relay, pb, status_of
from tests.support.api import Api, assert_error, bearer
from tests.support.server import ServerProcess

BUDGET = 20
#: One failure back every 30 s: no refill while the test runs, even on a loaded machine (at
#: 20/60, 300 requests on PostgreSQL beside other tests took over the 3 s of one refill).
PERIOD = 600
WRONG_KEY = "sk_live_" + "A" * 43


def _limited(response: httpx.Response) -> None:
    assert_error(response, 429, "too many requests")
    assert 1 <= int(response.headers["retry-after"]) <= PERIOD // BUDGET


def test_wrong_keys_are_limited_per_address(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server(
        "--signup-rate", "off", "--key-rate", "off", "--auth-failure-rate", f"{BUDGET}/{PERIOD}"
    )
    api = Api(server.http_url)
    try:
        known = api.signup()
        assert api.me(known.key).status_code == 200  # works from here: remembered
        token = api.token(known.key)  # so does the token minted here
        unknown = api.signup()  # its key has not authenticated from here yet

        # Every kind of failure spends the budget, on every authenticating route.
        failures: list[Callable[[], httpx.Response]] = [
            lambda: api.me(WRONG_KEY),
            lambda: api.http.get("/v1/keys", headers=bearer(WRONG_KEY)),
            lambda: api.http.post("/v1/tokens", headers=bearer(WRONG_KEY)),
            lambda: api.http.post("/v1/keys", headers=bearer(WRONG_KEY), json={}),
            lambda: api.http.delete(f"/v1/keys/{known.id}", headers=bearer(WRONG_KEY)),
            lambda: api.me(token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")),
            lambda: api.http.get("/v1/accounts/me"),
            lambda: api.http.get("/v1/keys", headers={"Authorization": "Basic eDp5"}),
        ]
        for i in range(BUDGET):
            assert failures[i % len(failures)]().status_code == 401
        for attempt in failures:
            _limited(attempt())
        # Hundreds more guesses (the issue made 1,500 in 1.5 s): none is even looked at.
        limited = sum(api.me(WRONG_KEY).status_code == 429 for _ in range(300))
        assert limited == 300

        # A good client sharing the address keeps working with what worked from here...
        for _ in range(5):
            assert api.me(known.key).status_code == 200
            assert api.me(token).status_code == 200
        assert api.http.get("/v1/keys", headers=bearer(known.key)).status_code == 200
        fresh = api.token(known.key)
        assert api.me(fresh).status_code == 200
        # ...and a credential new to this address waits like the guesser.
        _limited(api.me(unknown.key))
        # Routes that take no credential are not limited.
        assert api.http.get("/healthz").status_code == 200
        assert api.http.post("/v1/accounts", json={"email": "x@example.com"}).status_code == 200
    finally:
        api.close()


def test_bad_tokens_on_the_relay_are_limited_per_address(
    start_server: Callable[..., ServerProcess],
) -> None:
    server = start_server(
        "--signup-rate", "off", "--key-rate", "off", "--auth-failure-rate", f"{BUDGET}/{PERIOD}"
    )
    api = Api(server.http_url)
    try:
        owner = api.signup()
        known = api.token(owner.key)
        with Relay(server.relay_url) as relay:

            def code(token: str | None) -> tuple[grpc.StatusCode, dict[str, str]]:
                metadata = [("authorization", f"Bearer {token}")] if token else []
                try:
                    relay.stub.ListMembers(
                        pb.ListMembersRequest(channel="nobody/has/this"),
                        timeout=10,
                        metadata=metadata,
                    )
                except grpc.RpcError as exc:
                    status, _, trailers = status_of(exc)
                    return status, trailers
                return grpc.StatusCode.OK, {}

            assert code(known)[0] == grpc.StatusCode.NOT_FOUND  # works from here: remembered
            forged = known[:-4] + ("AAAA" if not known.endswith("AAAA") else "BBBB")
            for _ in range(BUDGET):
                assert code(forged)[0] == grpc.StatusCode.UNAUTHENTICATED
            status, trailers = code(forged)
            assert status == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert 1_000 <= int(trailers["static-retry-after-ms"]) <= PERIOD // BUDGET * 1_000
            # The token that worked from here still does; a new one waits like the forger.
            assert code(known)[0] == grpc.StatusCode.NOT_FOUND
            assert code(api.token(owner.key))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
            # No token at all is refused by the relay itself, as before (not counted here).
            assert code(None)[0] == grpc.StatusCode.UNAUTHENTICATED
        # The HTTP port keeps a budget of its own.
        assert api.me(owner.key).status_code == 200
        assert api.me(WRONG_KEY).status_code == 401
    finally:
        api.close()


#: The issue's attack: 128 connections from one address, guessing at once.
GUESSERS = 128
#: Guesses per connection: 1,024 in all, ten times what the budget lets through.
GUESSES = 8
#: The default budget (`--auth-failure-rate 100/60`), whose documented bound is the burst plus
#: the refill while the guessing lasts.
DEFAULT_RATE = (100, 60)


def guess_at_once(guess: Callable[[int], str], count: int = GUESSERS) -> tuple[Counter[str], float]:
    """``count`` threads, each calling ``guess(n)`` ``GUESSES`` times, released together: the
    outcomes counted, and the seconds the guessing took (from the release to the last answer)."""
    outcomes: Counter[str] = Counter()
    lock = threading.Lock()
    barrier = threading.Barrier(count + 1)

    def run(n: int) -> None:
        barrier.wait(30)
        for _ in range(GUESSES):
            try:
                outcome = guess(n)
            except Exception as exc:  # noqa: BLE001  (counted, and the test shows which)
                outcome = f"error {type(exc).__name__}: {exc}"
            with lock:
                outcomes[outcome] += 1

    threads = [threading.Thread(target=run, args=(n,), daemon=True) for n in range(count)]
    for thread in threads:
        thread.start()
    barrier.wait(30)
    started = time.monotonic()
    for thread in threads:
        thread.join(120)
        assert not thread.is_alive(), "a guesser did not finish within 120 s"
    return outcomes, time.monotonic() - started


def bound(elapsed: float, rate: tuple[int, int] = DEFAULT_RATE) -> int:
    """The documented bound on failures answered: the burst, the refill while the guessing
    lasted, and 2 for a refill the test's clock and the server's disagree on."""
    requests, per_seconds = rate
    return requests + math.ceil(elapsed * requests / per_seconds) + 2


@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/accounts/me"), ("POST", "/v1/tokens")])
def test_concurrent_guessers_get_no_more_than_the_budget(
    start_server: Callable[..., ServerProcess], method: str, path: str
) -> None:
    """The budget holds under concurrency: each guess pays for its failure before its key is
    looked up. On 9b2be07 the bucket was checked, the lookup awaited and only then the failure
    counted, so guesses in flight together all passed (issue 27: 2,285 answers of 401 on /me
    and 2,340 on /v1/tokens from 128 connections, against about 120)."""
    requests, per_seconds = DEFAULT_RATE
    server = start_server(
        "--signup-rate", "off", "--key-rate", "off",
        "--auth-failure-rate", f"{requests}/{per_seconds}",
    )  # fmt: skip
    url = urlsplit(server.http_url)
    assert url.hostname is not None and url.port is not None
    connections = [
        http.client.HTTPConnection(url.hostname, url.port, timeout=30) for _ in range(GUESSERS)
    ]

    def guess(n: int) -> str:
        # A new well-formed key each time: each is looked up in the store, none exists.
        headers = {"Authorization": f"Bearer {generate_api_key().secret}"}
        try:
            connections[n].request(method, path, headers=headers)
            response = connections[n].getresponse()
            response.read()
        except (http.client.HTTPException, ConnectionError):
            # The server may close a connection: the guesser opens another, as an attacker would.
            connections[n].close()
            raise
        return str(response.status)

    try:
        outcomes, elapsed = guess_at_once(guess)
    finally:
        for connection in connections:
            connection.close()
    assert set(outcomes) <= {"401", "429"}, outcomes
    assert outcomes["401"] + outcomes["429"] == GUESSERS * GUESSES
    assert outcomes["401"] <= bound(elapsed), (outcomes, f"{elapsed:.1f} s")
    # Fewer than the burst would mean good credentials were refused: every guess was counted.
    assert outcomes["401"] >= requests, outcomes
