"""POST /v1/keys, GET /v1/keys, DELETE /v1/keys/:id (docs/http-api.md: Errors, API keys)."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime

from tests.api.conftest import NO_LIMITS
from tests.support.api import Api, assert_error, bearer
from tests.support.server import ServerProcess

TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z")


def _time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def test_create_key_returns_the_secret_once(api: Api) -> None:
    signed = api.signup()
    response = api.http.post("/v1/keys", headers=bearer(signed.key), json={"name": "ci"})
    assert response.status_code == 200
    assert response.headers["cache-control"] == "no-store"
    created = response.json()
    # The spec's fields, and what a key may do (docs/http-api.md "Keys for agents").
    assert set(created) == {"id", "key_prefix", "name", "key", "scopes", "channels", "expires_at"}
    assert created["scopes"] == ["keys", "channels"]
    assert created["channels"] is None and created["expires_at"] is None
    assert str(uuid.UUID(created["id"])) == created["id"]
    assert created["name"] == "ci"
    assert re.fullmatch(r"sk_live_[0-9A-Za-z]{43}", created["key"])
    assert created["key_prefix"] == created["key"][:16]
    assert created["key_prefix"].startswith("sk_live_")
    # The new key works on its own, for the same account.
    assert api.me(created["key"]).json()["id"] == signed.id


def test_key_name_defaults_to_default(api: Api) -> None:
    signed = api.signup()
    assert api.create_key(signed.key)["name"] == "default"
    assert api.create_key(signed.key, name=None)["name"] == "default"
    empty = api.http.post("/v1/keys", headers=bearer(signed.key))
    assert empty.status_code == 200 and empty.json()["name"] == "default"
    # The first key (made by POST /v1/accounts) is named default too.
    assert [k["name"] for k in api.keys(signed.key)].count("default") == 4


def test_key_name_validation(api: Api) -> None:
    signed = api.signup()
    for body, text in [
        ({"name": 5}, "name must be a string"),
        ({"name": ["x"]}, "name must be a string"),
        ({"name": "x" * 201}, "name must be at most 200 characters"),
        ({"name": "tab\tinside"}, "name contains invalid characters"),
    ]:
        response = api.http.post("/v1/keys", headers=bearer(signed.key), json=body)
        assert_error(response, 400, text)
    assert len(api.keys(signed.key)) == 1


def test_list_shows_active_keys_newest_first_without_secrets(api: Api) -> None:
    signed = api.signup()
    made = [api.create_key(signed.key, name=f"k{i}") for i in range(3)]
    response = api.http.get("/v1/keys", headers=bearer(signed.key))
    assert response.status_code == 200
    assert set(response.json()) == {"keys"}
    keys = response.json()["keys"]
    assert [k["name"] for k in keys] == ["k2", "k1", "k0", "default"]
    assert [k["id"] for k in keys[:3]] == [m["id"] for m in reversed(made)]
    for key in keys:
        assert set(key) == {
            "id",
            "key_prefix",
            "name",
            "last_used_at",
            "created_at",
            "scopes",
            "channels",
            "expires_at",
        }
        assert TIMESTAMP.fullmatch(key["created_at"])
        assert key["key_prefix"].startswith("sk_live_") and len(key["key_prefix"]) == 16
    created = [_time(k["created_at"]) for k in keys]
    assert created == sorted(created, reverse=True)
    for secret in [signed.key, *(m["key"] for m in made)]:
        assert secret not in response.text


def test_list_shows_only_the_callers_keys(api: Api) -> None:
    alice, bob = api.signup(), api.signup()
    api.create_key(bob.key, name="bobs")
    assert [k["name"] for k in api.keys(alice.key)] == ["default"]
    assert sorted(k["name"] for k in api.keys(bob.key)) == ["bobs", "default"]


def test_last_used_at_is_null_until_used_then_set(api: Api) -> None:
    signed = api.signup()
    unused = api.create_key(signed.key, name="unused")
    used = api.create_key(signed.key, name="used")
    before = datetime.now(UTC)
    assert api.me(used["key"]).status_code == 200
    by_name = {k["name"]: k for k in api.keys(signed.key)}
    assert by_name["unused"]["last_used_at"] is None
    assert by_name["unused"]["id"] == unused["id"]
    last_used = by_name["used"]["last_used_at"]
    assert last_used is not None and TIMESTAMP.fullmatch(last_used)
    assert _time(last_used) >= before.replace(microsecond=0)
    # And again a second later, when the coalesced write has been flushed.
    time.sleep(1.1)
    assert api.me(used["key"]).status_code == 200
    later = {k["name"]: k for k in api.keys(signed.key)}["used"]["last_used_at"]
    assert _time(later) > _time(last_used)


def test_revoke_is_204_then_404_and_the_key_stops_working(api: Api) -> None:
    signed = api.signup()
    victim = api.create_key(signed.key, name="victim")
    assert api.me(victim["key"]).status_code == 200
    response = api.revoke(signed.key, victim["id"])
    assert response.status_code == 204
    assert response.content == b""
    assert "content-type" not in response.headers
    assert_error(api.me(victim["key"]), 401, "invalid or revoked api key")
    assert_error(api.revoke(signed.key, victim["id"]), 404, "Not found")
    assert [k["name"] for k in api.keys(signed.key)] == ["default"]


def test_revoke_the_key_in_use(api: Api) -> None:
    signed = api.signup()
    key_id = api.keys(signed.key)[0]["id"]
    assert api.revoke(signed.key, key_id).status_code == 204
    assert_error(api.revoke(signed.key, key_id), 401, "invalid or revoked api key")


def test_revoke_accepts_an_upper_case_id(api: Api) -> None:
    signed = api.signup()
    victim = api.create_key(signed.key)
    assert api.revoke(signed.key, victim["id"].upper()).status_code == 204


def test_cannot_revoke_another_accounts_key(api: Api) -> None:
    alice, bob = api.signup(), api.signup()
    bobs_key = api.keys(bob.key)[0]
    assert_error(api.revoke(alice.key, bobs_key["id"]), 404, "Not found")
    assert api.me(bob.key).status_code == 200
    assert [k["id"] for k in api.keys(bob.key)] == [bobs_key["id"]]


def test_revoke_unknown_or_malformed_id_is_404(api: Api) -> None:
    signed = api.signup()
    for key_id in [
        str(uuid.uuid4()),
        "not-a-uuid",
        "12345",
        "%00",
        "' OR 1=1 --",
        "00000000-0000-0000-0000-00000000000g",
        uuid.uuid4().hex,
    ]:
        assert_error(api.revoke(signed.key, key_id), 404, "Not found")
    assert len(api.keys(signed.key)) == 1


def test_key_endpoints_require_an_api_key(api: Api) -> None:
    signed = api.signup()
    key_id = api.keys(signed.key)[0]["id"]
    token = api.token(signed.key)
    for method, path in [
        ("POST", "/v1/keys"),
        ("GET", "/v1/keys"),
        ("DELETE", f"/v1/keys/{key_id}"),
        ("POST", "/v1/tokens"),
    ]:
        assert_error(api.http.request(method, path), 401, "missing authorization header")
        assert_error(api.http.request(method, path, headers=bearer(token)), 401, "api key required")
        assert_error(
            api.http.request(method, path, headers=bearer("sk_live_" + "0" * 43)),
            401,
            "invalid or revoked api key",
        )
    # Nothing was created or revoked.
    assert [k["id"] for k in api.keys(signed.key)] == [key_id]


def test_at_most_100_active_keys(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server(*NO_LIMITS)
    api = Api(server.http_url)
    try:
        signed = api.signup()
        for _ in range(99):
            api.create_key(signed.key)
        response = api.http.post("/v1/keys", headers=bearer(signed.key))
        assert_error(response, 409, "too many active keys")
        keys = api.keys(signed.key)
        assert len(keys) == 100
        # Revoking one makes room for one.
        assert api.revoke(signed.key, keys[0]["id"]).status_code == 204
        api.create_key(signed.key)
        assert_error(api.http.post("/v1/keys", headers=bearer(signed.key)), 409)
    finally:
        api.close()
