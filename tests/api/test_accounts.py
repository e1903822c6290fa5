"""POST /v1/accounts and GET /v1/accounts/me (docs/http-api.md: Errors, Accounts)."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.api.conftest import NO_LIMITS
from tests.support.api import Api, assert_error, bearer, db_execute, unique_email
from tests.support.server import ServerProcess

KEY = re.compile(r"sk_live_[0-9A-Za-z]{43}")


def test_create_account_returns_the_account_and_its_first_key(api: Api) -> None:
    email = unique_email()
    response = api.http.post("/v1/accounts", json={"email": email, "name": "Ada"})
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.headers["cache-control"] == "no-store"
    body = response.json()
    assert set(body) == {"account", "api_key"}
    account = body["account"]
    assert set(account) == {"id", "email", "name", "plan_tier"}
    assert str(uuid.UUID(account["id"])) == account["id"]
    assert account["email"] == email
    assert account["name"] == "Ada"
    assert account["plan_tier"] == "free"
    assert KEY.fullmatch(body["api_key"])


def test_name_is_optional_and_null_when_absent(api: Api) -> None:
    assert api.signup().account["name"] is None
    assert api.signup(name=None).account["name"] is None
    assert api.signup(name="   ").account["name"] is None


def test_surrounding_whitespace_is_dropped(api: Api) -> None:
    email = unique_email()
    signed = api.signup(f"  {email}\t", name="  Grace  ")
    assert signed.account["email"] == email
    assert signed.account["name"] == "Grace"


def test_each_account_gets_its_own_id_and_key(api: Api) -> None:
    first, second = api.signup(), api.signup()
    assert first.id != second.id
    assert first.key != second.key


def test_me_with_the_api_key(api: Api) -> None:
    signed = api.signup(name="Me")
    response = api.me(signed.key)
    assert response.status_code == 200
    assert response.json() == signed.account


def test_me_with_a_jwt(api: Api) -> None:
    signed = api.signup()
    response = api.me(api.token(signed.key))
    assert response.status_code == 200
    assert response.json() == signed.account


def test_me_without_authorization_header(api: Api) -> None:
    response = api.http.get("/v1/accounts/me")
    assert_error(response, 401, "missing authorization header")
    assert response.headers["www-authenticate"].startswith("Bearer")


@pytest.mark.parametrize(
    "credential",
    [
        "sk_live_" + "A" * 43,  # well-formed, unknown
        "sk_live_short",
        "not-a-key",
        "sk_test_" + "A" * 43,
    ],
)
def test_me_with_an_unknown_key(api: Api, credential: str) -> None:
    assert_error(api.me(credential), 401, "invalid or revoked api key")


def test_me_with_a_revoked_key(api: Api) -> None:
    signed = api.signup()
    key_id = api.keys(signed.key)[0]["id"]
    other = api.create_key(signed.key)["key"]
    assert api.revoke(other, key_id).status_code == 204
    assert_error(api.me(signed.key), 401, "invalid or revoked api key")


def test_me_when_the_account_is_gone(api: Api, shared_server: ServerProcess) -> None:
    signed = api.signup()
    token = api.token(signed.key)
    # An operator removes the account row behind the store's back.
    assert shared_server.database_url is not None
    db_execute(
        shared_server.database_url,
        f"DELETE FROM accounts WHERE id = '{signed.id}'",
        bypass_foreign_keys=True,
    )
    assert_error(api.me(signed.key), 404, "Not found")
    assert_error(api.me(token), 404, "Not found")


@pytest.mark.parametrize(
    "body",
    [{}, {"email": ""}, {"email": "   "}, {"email": None}, {"name": "only a name"}],
    ids=["missing", "empty", "blank", "null", "name-only"],
)
def test_email_is_required(api: Api, body: dict[str, object]) -> None:
    assert_error(api.http.post("/v1/accounts", json=body), 400, "email is required")


def test_an_empty_body_lacks_the_email(api: Api) -> None:
    assert_error(api.http.post("/v1/accounts"), 400, "email is required")


@pytest.mark.parametrize(
    ("body", "text"),
    [
        ({"email": 42}, "email must be a string"),
        ({"email": ["a@b.c"]}, "email must be a string"),
        ({"email": {"x": 1}}, "email must be a string"),
        ({"email": True}, "email must be a string"),
        ({"email": "no-at-sign"}, "invalid email"),
        ({"email": "two@@example.com"}, "invalid email"),
        ({"email": "a@b@example.com"}, "invalid email"),
        ({"email": "@example.com"}, "invalid email"),
        ({"email": "user@"}, "invalid email"),
        ({"email": "us er@example.com"}, "invalid email"),
        ({"email": "x" * 243 + "@example.com"}, "email must be at most 254 characters"),
        ({"email": "a\x00b@example.com"}, "email contains invalid characters"),
        ({"email": unique_email(), "name": 7}, "name must be a string"),
        ({"email": unique_email(), "name": "n" * 201}, "name must be at most 200 characters"),
        ({"email": unique_email(), "name": "bell\x07"}, "name contains invalid characters"),
    ],
)
def test_invalid_fields(api: Api, body: dict[str, object], text: str) -> None:
    assert_error(api.http.post("/v1/accounts", json=body), 400, text)


def test_limits_are_inclusive(api: Api) -> None:
    email = "x" * 242 + "@example.com"
    assert len(email) == 254
    signed = api.signup(email, name="n" * 200)
    assert signed.account["email"] == email
    assert signed.account["name"] == "n" * 200


def test_lone_surrogate_is_refused_not_a_server_error(api: Api) -> None:
    body = b'{"email": "\\ud800@example.com"}'
    response = api.http.post(
        "/v1/accounts", content=body, headers={"Content-Type": "application/json"}
    )
    assert_error(response, 400, "email contains invalid characters")


def test_unicode_is_kept(api: Api) -> None:
    email = f"zoë-{uuid.uuid4().hex[:8]}@exämple.com"
    signed = api.signup(email, name="Zoë 🦊")
    assert api.me(signed.key).json() == {**signed.account, "email": email, "name": "Zoë 🦊"}


def test_duplicate_email_is_409_case_insensitively(api: Api) -> None:
    email = unique_email()
    first = api.signup(email)
    for again in (email, email.upper(), f" {email.title()} "):
        response = api.http.post("/v1/accounts", json={"email": again})
        assert_error(response, 409, "email already registered")
    # The first account is untouched.
    assert api.me(first.key).json() == first.account


def test_unknown_fields_are_ignored(api: Api) -> None:
    signed = api.signup(plan_tier="enterprise", id="00000000-0000-0000-0000-000000000000")
    assert signed.account["plan_tier"] == "free"
    assert signed.account["id"] != "00000000-0000-0000-0000-000000000000"


def test_concurrent_signups_with_one_email_create_one_account(
    start_server: Callable[..., ServerProcess],
) -> None:
    server = start_server(*NO_LIMITS)
    email = unique_email()
    variants = [email, email.upper(), email.capitalize()] * 8

    def post(address: str) -> httpx.Response:
        with httpx.Client(base_url=server.http_url, timeout=20) as client:
            return client.post("/v1/accounts", json={"email": address})

    with ThreadPoolExecutor(len(variants)) as pool:
        responses = list(pool.map(post, variants))
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200] + [409] * (len(variants) - 1), statuses
    for response in responses:
        if response.status_code == 409:
            assert response.json() == {"error": "email already registered"}
    winner = next(r for r in responses if r.status_code == 200).json()
    me = httpx.get(f"{server.http_url}/v1/accounts/me", headers=bearer(winner["api_key"]))
    assert me.json() == winner["account"]
    assert server.database_url is not None
    count = db_execute(server.database_url, "SELECT count(*) FROM accounts")
    assert count == "1"
