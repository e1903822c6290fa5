"""Rate limits: 429 with Retry-After, per client address for signups and per API key otherwise."""

from __future__ import annotations

from collections.abc import Callable

import httpx

from tests.support.api import Api, assert_error, bearer, unique_email
from tests.support.server import ServerProcess


def _retry_after(response: httpx.Response) -> int:
    assert_error(response, 429, "too many requests")
    seconds = int(response.headers["retry-after"])
    assert 1 <= seconds <= 60
    return seconds


def test_rate_limits(start_server: Callable[..., ServerProcess]) -> None:
    # The signup limit from the environment, the key limit from the command line.
    server = start_server("--key-rate", "3/60", env={"STATIC_SIGNUP_RATE": "2/60"})
    api = Api(server.http_url)
    try:
        first = api.signup()
        api.signup()
        _retry_after(api.http.post("/v1/accounts", json={"email": unique_email()}))
        # Refused signups count too; still limited.
        _retry_after(api.http.post("/v1/accounts", json={}))

        # Key A: one request to make key B, two more, then 429 on any endpoint.
        key_b = api.create_key(first.key, name="b")["key"]
        assert api.me(first.key).status_code == 200
        assert api.http.get("/v1/keys", headers=bearer(first.key)).status_code == 200
        _retry_after(api.me(first.key))
        _retry_after(api.http.post("/v1/tokens", headers=bearer(first.key)))
        # Key B of the same account has its own budget; its JWTs spend it.
        token = api.token(key_b)
        assert api.me(token).status_code == 200
        assert api.me(key_b).status_code == 200
        _retry_after(api.me(token))
        # Unauthenticated requests are refused before any limit applies.
        assert_error(api.http.get("/v1/accounts/me"), 401, "missing authorization header")
    finally:
        api.close()


def test_limits_can_be_disabled(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server("--signup-rate", "off", "--key-rate", "off")
    api = Api(server.http_url)
    try:
        signed = api.signup()
        for _ in range(15):
            api.signup()
        for _ in range(30):
            assert api.me(signed.key).status_code == 200
    finally:
        api.close()
