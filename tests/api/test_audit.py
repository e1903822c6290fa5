"""GET /v1/audit (docs/http-api.md "Audit log"): the account's key events and the relay's channel
events merged newest first, paged by cursor, one account's only, pruned past the retention."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any

from static.store import relay_database
from tests.api.conftest import NO_LIMITS
from tests.support.api import Api, assert_error, bearer, db_execute
from tests.support.server import ServerProcess


def _events(api: Api, key: str, **params: Any) -> dict[str, Any]:
    response = api.http.get("/v1/audit", headers=bearer(key), params=params)
    assert response.status_code == 200, response.text
    assert set(response.json()) == {"events", "next_cursor"}
    page: dict[str, Any] = response.json()
    return page


def _all(api: Api, key: str, limit: int) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    cursor = None
    for _ in range(100):
        params: dict[str, Any] = {"limit": limit}
        if cursor is not None:
            params["cursor"] = cursor
        page = _events(api, key, **params)
        assert len(page["events"]) <= limit
        events += page["events"]
        cursor = page["next_cursor"]
        if cursor is None:
            return events
    raise AssertionError("too many pages")


def _relay_url(database_url: str) -> str:
    """Where the relay's tables are: the same PostgreSQL database, or SQLite's relay file."""
    location = relay_database(database_url)
    return location if location.startswith("postgres") else f"sqlite:///{location}"


def _ms(event: dict[str, Any]) -> int:
    at = datetime.fromisoformat(event["at"].replace("Z", "+00:00"))
    return int(at.timestamp() * 1000)


def test_key_events_newest_first_without_secrets(api: Api) -> None:
    signed = api.signup()
    first = api.keys(signed.key)[0]["id"]
    made = api.create_key(signed.key, name="ci")
    assert api.revoke(signed.key, made["id"]).status_code == 204
    other = api.create_key(signed.key, name="agent")
    rolled = api.http.post(f"/v1/keys/{other['id']}/roll", headers=bearer(signed.key)).json()
    page = _events(api, signed.key)
    assert page["next_cursor"] is None
    events = page["events"]
    assert [e["type"] for e in events] == [
        "key.rolled",
        "key.created",
        "key.revoked",
        "key.created",
        "key.created",
    ]
    for event in events:
        assert list(event)[:4] == ["id", "at", "type", "key_id"]
        assert event["id"].startswith("k")
        assert event["at"].endswith("Z")
    assert len({e["id"] for e in events}) == 5
    roll, created_other, revoked, created_ci, signup = events
    assert roll["key_id"] == first and roll["target_key_id"] == other["id"]
    assert roll["new_key_id"] == rolled["id"] and roll["name"] == "agent"
    assert created_other["target_key_id"] == other["id"] and created_other["name"] == "agent"
    assert revoked["target_key_id"] == made["id"] and revoked["reason"] == "deleted"
    assert created_ci["key_id"] == first
    # The account's first key: made by no key.
    assert signup["key_id"] is None and signup["target_key_id"] == first
    text = api.http.get("/v1/audit", headers=bearer(signed.key)).text
    for secret in (signed.key, made["key"], other["key"], rolled["key"]):
        assert secret not in text
        assert secret[16:] not in text


def test_paging_with_the_cursor(api: Api) -> None:
    signed = api.signup()
    for i in range(6):
        api.create_key(signed.key, name=f"k{i}")
    everything = _events(api, signed.key, limit=200)["events"]
    assert len(everything) == 7
    for limit in (1, 2, 3, 7):
        assert _all(api, signed.key, limit) == everything
    page = _events(api, signed.key, limit=7)
    assert page["next_cursor"] is None


def test_another_account_sees_none_of_it(api: Api) -> None:
    signed = api.signup()
    api.create_key(signed.key)
    other = api.signup()
    events = _events(api, other.key)["events"]
    assert [e["type"] for e in events] == ["key.created"]
    mine = {e["id"] for e in _events(api, signed.key)["events"]}
    assert not mine & {e["id"] for e in events}
    # A cursor from another account's page shows only the caller's events anyway.
    cursor = _events(api, signed.key, limit=1)["next_cursor"]
    assert cursor is not None
    assert all(e["id"] not in mine for e in _events(api, other.key, cursor=cursor)["events"])


def test_query_validation(api: Api) -> None:
    signed = api.signup()
    limit_text = "limit must be an integer between 1 and 200"
    for params, text in [
        ("limit=0", limit_text),
        ("limit=201", limit_text),
        ("limit=abc", limit_text),
        ("limit=-1", limit_text),
        ("limit=1.5", limit_text),
        ("limit=", limit_text),
        ("limit=%EF%BC%91", limit_text),
        ("limit=1&limit=2", "limit and cursor may each be given once"),
        ("cursor=zzz", "invalid cursor"),
        ("cursor=", "invalid cursor"),
        ("cursor=1.x2", "invalid cursor"),
        ("cursor=1.k99999999999999999999", "invalid cursor"),
    ]:
        response = api.http.get(f"/v1/audit?{params}", headers=bearer(signed.key))
        assert_error(response, 400, text)
    # A cursor of the right form is a position, whatever it was made from.
    assert _events(api, signed.key, cursor="0.k0")["events"] == []
    assert len(_events(api, signed.key, cursor="99999999999999.r5")["events"]) == 1
    # Refusals before anything else: no credential, a JWT.
    assert_error(api.http.get("/v1/audit?limit=0"), 401, "missing authorization header")
    token = api.token(signed.key)
    assert_error(api.http.get("/v1/audit", headers=bearer(token)), 401, "api key required")


def test_relay_events_are_merged(api: Api, shared_database_url: str) -> None:
    signed = api.signup()
    api.create_key(signed.key, name="between")
    created = _events(api, signed.key)["events"]
    # One relay event before the account's key events, one between them, one after; and one of
    # another account. Times are the key events' own, to the ms.
    newest, oldest = _ms(created[0]), _ms(created[-1])
    relay = _relay_url(shared_database_url)
    detail = json.dumps({"identity": "agent-1", "member_account": "m", "id": "forged"})
    rows = [
        (oldest - 1000, "channel.created", "{}"),
        (oldest + (newest - oldest) // 2, "member.added", detail),
        (newest + 1000, "retention.changed", "not json"),
    ]
    for at_ms, type_, text in rows:
        db_execute(
            relay,
            "INSERT INTO relay_audit (account, at_ms, type, key_id, channel, detail) VALUES "
            f"('{signed.id}', {at_ms}, '{type_}', NULL, 'acme/agents/planner', '{text}')",
        )
    db_execute(
        relay,
        "INSERT INTO relay_audit (account, at_ms, type, key_id, channel, detail) VALUES "
        f"('{uuid.uuid4()}', {newest}, 'org.claimed', NULL, 'x/y/z', '{{}}')",
    )
    events = _events(api, signed.key)["events"]
    types = [e["type"] for e in events]
    assert types[0] == "retention.changed" and types[-1] == "channel.created"
    assert "member.added" in types and "org.claimed" not in types
    assert len(events) == 5
    times = [e["at"] for e in events]
    assert times == sorted(times, reverse=True)
    added = events[types.index("member.added")]
    assert added["id"].startswith("r") and added["id"] != "forged"
    assert added["identity"] == "agent-1" and added["channel"] == "acme/agents/planner"
    assert events[0]["channel"] == "acme/agents/planner"
    # Paging across both sources gives the same events.
    assert _all(api, signed.key, 1) == events
    assert _all(api, signed.key, 2) == events


def test_expired_keys_are_noted_once(api: Api) -> None:
    signed = api.signup()
    short = api.create_key(signed.key, expires_in=1)

    def expired() -> list[dict[str, Any]]:
        events = _events(api, signed.key)["events"]
        return [e for e in events if e["type"] == "key.expired"]

    deadline = time.monotonic() + 8
    while not expired():
        assert time.monotonic() < deadline
        time.sleep(0.3)
    time.sleep(2.5)  # another sweep: still once
    (event,) = expired()
    assert event["target_key_id"] == short["id"] and event["key_id"] is None


def test_the_sweeps_events_come_after_what_was_read_before_them(api: Api) -> None:
    """A reader that polls for events newer than the newest it saw gets the sweep's too: they
    are written at the sweep's time (the moment they speak of in their own field), never
    behind events already handed out (the CLI test failed on a revocation at the grace end
    that sorted under a later event)."""
    signed = api.signup()
    old = api.create_key(signed.key, name="old")
    short = api.create_key(signed.key, name="short", expires_in=1)
    rolled = api.http.post(
        f"/v1/keys/{old['id']}/roll", headers=bearer(signed.key), json={"grace_seconds": 0}
    )
    assert rolled.status_code == 200, rolled.text
    time.sleep(0.01)
    later = api.create_key(signed.key, name="later")  # after the grace end
    seen = _events(api, signed.key)["events"]
    assert seen[0]["target_key_id"] == later["id"]

    def swept(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        return {e["type"]: e for e in events if e["type"] in ("key.revoked", "key.expired")}

    deadline = time.monotonic() + 10
    while len(swept(_events(api, signed.key)["events"])) < 2:
        assert time.monotonic() < deadline, "not swept"
        time.sleep(0.3)
    events = _events(api, signed.key)["events"]
    newer = events[: [e["id"] for e in events].index(seen[0]["id"])]
    found = swept(newer)
    assert set(found) == {"key.revoked", "key.expired"}, [e["type"] for e in events]
    revoked, expired = found["key.revoked"], found["key.expired"]
    assert revoked["target_key_id"] == old["id"] and revoked["reason"] == "rolled"
    assert _ms(revoked) >= _ms(seen[0]) and revoked["revoked_at"] <= seen[0]["at"]
    assert expired["target_key_id"] == short["id"]
    assert expired["expires_at"] == short["expires_at"] and expired["at"] >= short["expires_at"]


def test_retention_prunes(start_server: Callable[..., ServerProcess], database_url: str) -> None:
    # 0.00003 days: 2.6 s, pruned every 1.3 s.
    server = start_server(*NO_LIMITS, "--audit-retention-days", "0.00003")
    api = Api(server.http_url)
    try:
        signed = api.signup()
        api.create_key(signed.key)
        assert len(_events(api, signed.key)["events"]) == 2
        count = f"SELECT count(*) FROM audit_events WHERE account = '{signed.id}'"
        assert db_execute(database_url, count) == "2"
        deadline = time.monotonic() + 10
        while db_execute(database_url, count) != "0":
            assert time.monotonic() < deadline, "not pruned"
            time.sleep(0.3)
        assert _events(api, signed.key)["events"] == []
    finally:
        api.close()
