"""Keys for agents: scopes, channel patterns, expiry, roll and the account's rate
(docs/http-api.md "Keys for agents"), over HTTP on both stores; and the relay's port
(``inactive_keys``, ``key_is_active``, the revocation listeners) in process."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import jwt
import pytest
import trio

from static._settings import ApiSettings
from static.auth import (
    SigningKey,
    TokenRules,
    Unauthenticated,
    generate_api_key,
    open_authority,
)
from static.auth._tokens import TokenVerifierCore
from static.store import NewKey, open_database
from tests.api.conftest import NO_LIMITS
from tests.support.api import Api, assert_error, bearer
from tests.support.server import ServerProcess

#: The sweep runs every 2 s (ApiSettings.key_sweep_seconds): waits allow for two.
SWEEP_WAIT = 5.0


def _time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def _claims(token: str) -> dict[str, Any]:
    claims: dict[str, Any] = jwt.decode(token, options={"verify_signature": False})
    return claims


def _until(check: Callable[[], bool], timeout: float = SWEEP_WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.2)


# -- scopes -------------------------------------------------------------------------------


def test_a_key_without_the_keys_scope_cannot_manage_keys(api: Api) -> None:
    signed = api.signup()
    agent = api.create_key(signed.key, name="agent", scopes=["channels"])
    assert agent["scopes"] == ["channels"]
    other = api.create_key(signed.key)["id"]
    lacks = "api key lacks the keys scope"
    headers = bearer(agent["key"])
    assert_error(api.http.get("/v1/keys", headers=headers), 403, lacks)
    assert_error(api.http.post("/v1/keys", headers=headers, json={}), 403, lacks)
    assert_error(api.http.delete(f"/v1/keys/{other}", headers=headers), 403, lacks)
    assert_error(api.http.post(f"/v1/keys/{other}/roll", headers=headers), 403, lacks)
    assert_error(api.http.get("/v1/audit", headers=headers), 403, lacks)
    # Its own work is untouched: a token, and who it is.
    assert api.http.post("/v1/tokens", headers=headers).status_code == 200
    assert api.me(agent["key"]).status_code == 200
    # Nothing was revoked by the refused DELETE.
    assert other in {k["id"] for k in api.keys(signed.key)}


def test_a_key_without_the_channels_scope_gets_no_token(api: Api) -> None:
    signed = api.signup()
    admin = api.create_key(signed.key, scopes=["keys"])
    assert admin["scopes"] == ["keys"]
    response = api.http.post("/v1/tokens", headers=bearer(admin["key"]))
    assert_error(response, 403, "api key lacks the channels scope")
    assert len(api.keys(admin["key"])) == 2
    listed = {k["id"]: k for k in api.keys(signed.key)}
    assert listed[admin["id"]]["scopes"] == ["keys"]
    # The account's first key has both.
    first = next(k for k in listed.values() if k["id"] != admin["id"])
    assert first["scopes"] == ["keys", "channels"]
    assert first["channels"] is None and first["expires_at"] is None


def test_scopes_validation(api: Api) -> None:
    signed = api.signup()
    for scopes, text in [
        ([], "scopes must have 1 to 2 entries"),
        (["admin"], "scopes must be a non-empty list of keys and channels"),
        (["keys", "keys"], "scopes must not repeat an entry"),
        ("keys", "scopes must be a list of strings"),
        ([1], "scopes must be a list of strings"),
        (["keys", "channels", "keys"], "scopes must have 1 to 2 entries"),
    ]:
        response = api.http.post("/v1/keys", headers=bearer(signed.key), json={"scopes": scopes})
        assert_error(response, 400, text)
    # Either order, one order back; null is the default.
    assert api.create_key(signed.key, scopes=["channels", "keys"])["scopes"] == ["keys", "channels"]
    assert api.create_key(signed.key, scopes=None)["scopes"] == ["keys", "channels"]
    assert len(api.keys(signed.key)) == 3


# -- channel patterns -----------------------------------------------------------------------


def test_channel_patterns_are_validated(api: Api) -> None:
    signed = api.signup()
    bad = [
        "a/b",
        "a/b/c/d",
        "",
        "*x/b/c",
        "a/**/c",
        "-a/b/c",
        "a//c",
        "a/b/c\n",
        "é/b/c",
        "a b/c/d",
        "x" * 64 + "/b/c",
    ]
    for pattern in bad:
        response = api.http.post(
            "/v1/keys", headers=bearer(signed.key), json={"channels": [pattern]}
        )
        assert response.status_code == 400, pattern
        assert response.json()["error"].startswith("invalid channel pattern"), pattern
    for channels, text in [
        ([], "channels must have 1 to 100 entries"),
        ([f"o/n/s{i}" for i in range(101)], "channels must have 1 to 100 entries"),
        (["a/b/c", "a/b/c"], "channels must not repeat an entry"),
        ("a/b/c", "channels must be a list of strings"),
        ([None], "channels must be a list of strings"),
    ]:
        response = api.http.post(
            "/v1/keys", headers=bearer(signed.key), json={"channels": channels}
        )
        assert_error(response, 400, text)
    assert len(api.keys(signed.key)) == 1


def test_channel_patterns_travel_in_the_token(api: Api) -> None:
    signed = api.signup()
    patterns = ["acme/*/planner", "*/*/*", "x" * 63 + "/B-1/c.d_e"]
    agent = api.create_key(signed.key, channels=patterns)
    assert agent["channels"] == patterns
    listed = {k["id"]: k for k in api.keys(signed.key)}
    assert listed[agent["id"]]["channels"] == patterns
    assert _claims(api.token(agent["key"]))["channels"] == patterns
    # A key for every channel: no claim at all.
    assert "channels" not in _claims(api.token(signed.key))
    many = [f"o/n/s{i}" for i in range(100)]
    assert api.create_key(signed.key, channels=many)["channels"] == many


# -- expiry ---------------------------------------------------------------------------------


def test_expires_in_validation(api: Api) -> None:
    signed = api.signup()
    for value, text in [
        (True, "expires_in must be an integer"),
        (1.5, "expires_in must be an integer"),
        (10.5, "expires_in must be an integer"),
        ("60", "expires_in must be an integer"),
        ([60], "expires_in must be an integer"),
        (0, "expires_in must be between 1 and 31536000"),
        (-5, "expires_in must be between 1 and 31536000"),
        (31_536_001, "expires_in must be between 1 and 31536000"),
    ]:
        response = api.http.post("/v1/keys", headers=bearer(signed.key), json={"expires_in": value})
        assert_error(response, 400, text)
    # A number too large for a float is no integer either.
    response = api.http.post(
        "/v1/keys",
        headers={**bearer(signed.key), "Content-Type": "application/json"},
        content=b'{"expires_in": 1e999}',
    )
    assert_error(response, 400, "expires_in must be an integer")
    # 60.0 is 60 in JSON (and an integer to JSON Schema).
    assert api.create_key(signed.key, expires_in=60.0)["expires_at"] is not None
    before = datetime.now(UTC)
    year = api.create_key(signed.key, expires_in=31_536_000)
    expires = _time(year["expires_at"])
    assert before + timedelta(days=365) - timedelta(seconds=1) <= expires
    assert expires <= datetime.now(UTC) + timedelta(days=365, seconds=1)
    assert len(api.keys(signed.key)) == 3


def test_an_expired_key_and_its_tokens_stop(api: Api) -> None:
    signed = api.signup()
    short = api.create_key(signed.key, expires_in=2)
    response = api.http.post("/v1/tokens", headers=bearer(short["key"]))
    assert response.status_code == 200
    token = response.json()["access_token"]
    # Never outlives the key: capped at its remaining life.
    assert 1 <= response.json()["expires_in"] <= 2
    claims = _claims(token)
    assert claims["exp"] <= _time(short["expires_at"]).timestamp()
    assert api.me(token).status_code == 200
    time.sleep(2.2)
    assert_error(api.me(short["key"]), 401, "api key expired")
    assert_error(api.http.get("/v1/keys", headers=bearer(short["key"])), 401, "api key expired")
    assert_error(api.http.post("/v1/tokens", headers=bearer(short["key"])), 401, "api key expired")
    assert api.me(token).status_code == 401
    # Gone from the list at once (the sweep is not waited for).
    assert short["id"] not in {k["id"] for k in api.keys(signed.key)}
    # And cannot be revoked or rolled any more: it is not a working key.
    assert_error(api.revoke(signed.key, short["id"]), 404, "Not found")


def test_a_token_is_capped_at_the_keys_life(api: Api) -> None:
    signed = api.signup()
    key = api.create_key(signed.key, expires_in=100)
    response = api.http.post("/v1/tokens", headers=bearer(key["key"]))
    assert 99 <= response.json()["expires_in"] <= 100
    assert _claims(response.json()["access_token"])["exp"] <= _time(key["expires_at"]).timestamp()
    # A key living longer than a token: the configured lifetime.
    long = api.create_key(signed.key, expires_in=10_000)
    assert api.http.post("/v1/tokens", headers=bearer(long["key"])).json()["expires_in"] == 900


# -- roll -----------------------------------------------------------------------------------


def test_roll_gives_a_new_key_and_ends_the_old_after_the_grace(api: Api) -> None:
    signed = api.signup()
    old = api.create_key(
        signed.key, name="agent", scopes=["channels"], channels=["o/n/*"], expires_in=3600
    )
    response = api.http.post(
        f"/v1/keys/{old['id']}/roll", headers=bearer(signed.key), json={"grace_seconds": 3}
    )
    assert response.status_code == 200, response.text
    new = response.json()
    assert set(new) == {"id", "key_prefix", "name", "key", "scopes", "channels", "expires_at"}
    assert new["id"] != old["id"] and new["key"] != old["key"]
    assert (new["name"], new["scopes"], new["channels"]) == ("agent", ["channels"], ["o/n/*"])
    # A fresh expiry of the old key's original lifetime.
    assert _time(new["expires_at"]) > _time(old["expires_at"])
    assert abs((_time(new["expires_at"]) - datetime.now(UTC)).total_seconds() - 3600) < 30
    # During the grace both work; the old one's token ends with the grace.
    assert api.me(old["key"]).status_code == 200
    assert api.me(new["key"]).status_code == 200
    token = api.http.post("/v1/tokens", headers=bearer(old["key"])).json()
    assert token["expires_in"] <= 3
    # Rolled once: the old key cannot be rolled again.
    again = api.http.post(f"/v1/keys/{old['id']}/roll", headers=bearer(signed.key))
    assert_error(again, 404, "Not found")
    time.sleep(3.2)
    assert_error(api.me(old["key"]), 401, "invalid or revoked api key")
    assert api.me(token["access_token"]).status_code == 401
    assert api.me(new["key"]).status_code == 200
    assert [k["id"] for k in api.keys(signed.key)][:1] == [new["id"]]
    assert old["id"] not in {k["id"] for k in api.keys(signed.key)}

    # The sweep records the revocation (revoked_at; the event says why).
    def swept() -> bool:
        events = api.http.get("/v1/audit", headers=bearer(signed.key)).json()["events"]
        return any(
            e["type"] == "key.revoked" and e.get("target_key_id") == old["id"] for e in events
        )

    _until(swept)
    events = api.http.get("/v1/audit", headers=bearer(signed.key)).json()["events"]
    revoked = [e for e in events if e["type"] == "key.revoked"]
    assert revoked[0]["reason"] == "rolled" and revoked[0]["key_id"] is None


def test_roll_refusals(api: Api) -> None:
    signed = api.signup()
    other = api.signup()
    mine = api.create_key(signed.key)
    headers = bearer(signed.key)
    for key_id in [other.account["id"], str(uuid.uuid4()), "not-a-uuid"]:
        assert_error(api.http.post(f"/v1/keys/{key_id}/roll", headers=headers), 404, "Not found")
    theirs = api.keys(other.key)[0]["id"]
    assert_error(api.http.post(f"/v1/keys/{theirs}/roll", headers=headers), 404, "Not found")
    for grace, text in [
        (-1, "grace_seconds must be between 0 and 604800"),
        (604_801, "grace_seconds must be between 0 and 604800"),
        ("5", "grace_seconds must be an integer"),
        (True, "grace_seconds must be an integer"),
        (1.5, "grace_seconds must be an integer"),
    ]:
        response = api.http.post(
            f"/v1/keys/{mine['id']}/roll", headers=headers, json={"grace_seconds": grace}
        )
        assert_error(response, 400, text)
    assert api.revoke(signed.key, mine["id"]).status_code == 204
    assert_error(api.http.post(f"/v1/keys/{mine['id']}/roll", headers=headers), 404, "Not found")
    # A JWT is no key.
    token = api.token(signed.key)
    response = api.http.post(f"/v1/keys/{mine['id']}/roll", headers=bearer(token))
    assert_error(response, 401, "api key required")


def test_roll_without_a_body_and_with_no_grace(api: Api) -> None:
    signed = api.signup()
    keep = api.create_key(signed.key)
    first = api.http.post(f"/v1/keys/{keep['id']}/roll", headers=bearer(signed.key)).json()
    # No body: an hour's grace.
    assert api.me(keep["key"]).status_code == 200 and first["expires_at"] is None
    now = api.create_key(signed.key)
    response = api.http.post(
        f"/v1/keys/{now['id']}/roll", headers=bearer(signed.key), json={"grace_seconds": 0}
    )
    assert response.status_code == 200
    assert_error(api.me(now["key"]), 401, "invalid or revoked api key")
    # A key may roll itself.
    itself = api.http.post(f"/v1/keys/{first['id']}/roll", headers=bearer(first["key"]))
    assert itself.status_code == 200


# -- server settings ----------------------------------------------------------------------


def test_the_account_rate_bounds_all_its_keys(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server(
        "--signup-rate",
        "off",
        "--auth-failure-rate",
        "off",
        "--key-rate",
        "5/60",
        "--account-rate",
        "8/60",
    )
    api = Api(server.http_url)
    try:
        signed = api.signup()
        second = api.create_key(signed.key)  # 1 of the account's 8, 1 of this key's 5
        for _ in range(4):
            assert api.me(signed.key).status_code == 200  # the first key: 5 of 5
        for _ in range(3):
            assert api.me(second["key"]).status_code == 200  # account: 8 of 8
        # The second key has used 3 of its 5; the account is out.
        response = api.me(second["key"])
        assert_error(response, 429, "too many requests")
        assert int(response.headers["retry-after"]) >= 1
        # Another account is not.
        assert api.me(api.signup().key).status_code == 200
    finally:
        api.close()


def test_max_key_lifetime(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server(*NO_LIMITS, "--max-key-lifetime", "60")
    api = Api(server.http_url)
    try:
        signed = api.signup()
        headers = bearer(signed.key)
        response = api.http.post("/v1/keys", headers=headers, json={})
        assert_error(response, 400, "expires_in is required (at most 60 seconds)")
        response = api.http.post("/v1/keys", headers=headers, json={"expires_in": 61})
        assert_error(response, 400, "expires_in must be at most 60 seconds")
        made = api.create_key(signed.key, expires_in=60)
        assert made["expires_at"] is not None
        # The first key never expires; rolled under a maximum, its successor gets the maximum.
        first = next(k for k in api.keys(signed.key) if k["id"] != made["id"])
        rolled = api.http.post(f"/v1/keys/{first['id']}/roll", headers=headers).json()
        assert abs((_time(rolled["expires_at"]) - datetime.now(UTC)).total_seconds() - 60) < 10
    finally:
        api.close()


# -- the relay's port, in process ---------------------------------------------------------


async def test_inactive_keys_and_the_revocation_listeners(database_url: str) -> None:
    settings = ApiSettings(key_sweep_seconds=0.2)
    async with open_database(database_url) as db, open_authority(db, settings) as authority:
        heard: list[str] = []

        def failing(key_id: str) -> None:
            raise RuntimeError("a listener's bug")

        authority.add_revocation_listener(failing)
        authority.add_revocation_listener(heard.append)
        store = authority.store
        account_id = str(uuid.uuid4())
        now = datetime.now(UTC)

        def new(name: str, lifetime: int | None = None) -> NewKey:
            secret = generate_api_key()
            return NewKey(
                str(uuid.uuid4()), secret.digest, secret.key_prefix, name, lifetime_seconds=lifetime
            )

        first = new("first")
        await store.create_account(
            account_id=account_id,
            email=f"{account_id}@example.com",
            name=None,
            first_key=first,
            now=now,
        )
        live, doomed, short, rolled = new("live"), new("doomed"), new("short", 1), new("rolled")
        for key in (live, doomed, short, rolled):
            await store.create_key(account_id, key, now=now, max_active=100)
        successor = await store.roll_key(
            account_id, rolled.id, new("x"), now=now, grace_seconds=1, max_active=100
        )
        assert successor is not None and successor.name == "rolled"
        assert await authority.revoke_key(account_id, doomed.id, actor=first.id)
        assert heard == [doomed.id]
        unknown = str(uuid.uuid4())
        ids = [live.id, doomed.id, short.id, rolled.id, successor.id, unknown, "nope", ""]
        assert await authority.inactive_keys(ids) == {doomed.id, unknown, "nope", ""}
        assert await authority.key_is_active(short.id)
        # Past the expiry and the grace: inactive at once, then swept (the listeners hear).
        await trio.sleep(1.6)
        assert await authority.inactive_keys(ids) == {
            doomed.id,
            short.id,
            rolled.id,
            unknown,
            "nope",
            "",
        }
        assert not await authority.key_is_active(short.id)
        assert not await authority.key_is_active(rolled.id)
        assert await authority.key_is_active(successor.id)
        with trio.fail_after(5):
            while set(heard) != {doomed.id, short.id, rolled.id}:  # noqa: ASYNC110  (polled: a list)
                await trio.sleep(0.1)
        await trio.sleep(0.5)
        assert sorted(heard) == sorted([doomed.id, short.id, rolled.id])  # each once
        # Many ids: several bounded queries, one answer.
        many = [str(uuid.uuid4()) for _ in range(1200)] + [live.id]
        assert await authority.inactive_keys(many) == set(many) - {live.id}


async def test_verify_token_carries_the_channels(database_url: str) -> None:
    async with open_database(database_url) as db, open_authority(db, ApiSettings()) as authority:
        account_id = str(uuid.uuid4())
        secret = generate_api_key()
        key = NewKey(
            str(uuid.uuid4()),
            secret.digest,
            secret.key_prefix,
            "k",
            channels=("a/*/c",),
            lifetime_seconds=2,
        )
        await authority.store.create_account(
            account_id=account_id,
            email=f"{account_id}@example.com",
            name=None,
            first_key=key,
            now=datetime.now(UTC),
        )
        owner = await authority.authenticate_key(secret.secret)
        issued = authority.mint(owner)
        assert issued.expires_in <= 2
        principal = await authority.verify_token(issued.access_token)
        assert principal.channels == ("a/*/c",)
        await trio.sleep(2.1)
        with pytest.raises(Unauthenticated):
            await authority.verify_token(issued.access_token)
        with pytest.raises(Unauthenticated, match="api key expired"):
            await authority.authenticate_key(secret.secret)


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--max-key-lifetime", "0", "--max-key-lifetime must be between 1 and 31536000"),
        ("--max-key-lifetime", "31536001", "--max-key-lifetime must be between 1 and 31536000"),
        ("--audit-retention-days", "0", "--audit-retention-days must be above 0"),
        ("--audit-retention-days", "nan", "--audit-retention-days must be above 0"),
        ("--account-rate", "5", "argument --account-rate"),
    ],
)
def test_bad_settings_exit_2(tmp_path: Path, flag: str, value: str, says: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "static", "serve", "--data-dir", str(tmp_path), flag, value],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert says in result.stderr


def _signed(key: SigningKey, **claims: Any) -> str:
    now = int(time.time())
    payload = {
        "iss": "static",
        "sub": str(uuid.uuid4()),
        "aud": "static-relay",
        "iat": now,
        "nbf": now,
        "exp": now + 60,
        "jti": uuid.uuid4().hex,
        "key_id": str(uuid.uuid4()),
        **claims,
    }
    return jwt.encode(payload, key.private_key, algorithm="EdDSA", headers={"kid": key.kid})


@pytest.mark.parametrize(
    "channels",
    [
        [],
        "a/b/c",
        {"a": "b"},
        [1],
        [None],
        ["a/b/c", 2],
        [""],
        ["x" * 768],
        [f"o/n/s{i}" for i in range(101)],
        None,
        True,
    ],
)
def test_the_channels_claim_is_checked_strictly(channels: Any) -> None:
    key = SigningKey.generate()
    rules = TokenRules(issuer="static", audience="static-relay", ttl_seconds=900)
    verifier = TokenVerifierCore([key], rules)
    with pytest.raises(Unauthenticated, match="invalid or expired token"):
        verifier.verify(_signed(key, channels=channels))
    # The bounds themselves pass; no claim at all is every channel.
    fine = ["x" * 767, *(f"o/n/s{i}" for i in range(99))]
    assert verifier.verify(_signed(key, channels=fine)).channels == tuple(fine)
    assert verifier.verify(_signed(key)).channels is None


def test_a_roll_counts_against_the_key_limit(api: Api) -> None:
    signed = api.signup()
    made = [api.create_key(signed.key, name=f"k{i}") for i in range(99)]
    headers = bearer(signed.key)
    roll = api.http.post(f"/v1/keys/{made[0]['id']}/roll", headers=headers)
    assert_error(roll, 409, "too many active keys")
    assert_error(api.http.post("/v1/keys", headers=headers, json={}), 409, "too many active keys")
    # One revoked makes room for one roll; the old key counts until its grace ends.
    assert api.revoke(signed.key, made[1]["id"]).status_code == 204
    assert api.http.post(f"/v1/keys/{made[0]['id']}/roll", headers=headers).status_code == 200
    assert_error(api.http.post("/v1/keys", headers=headers, json={}), 409, "too many active keys")
