"""GET /v1/channels and GET /v1/channels/rate: an account's channels with their rosters, and its
message rate, read from the relay of the same process (members only, the key's scope and channel
patterns respected). Real SDK agents make the channels, on both backends."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from static._settings import ServerSettings
from static.api import create_app
from static.auth import open_authority
from static.store import open_database
from static_sdk import StaticClient
from tests.support.api import Api, SignedUp, assert_error, bearer
from tests.support.server import ServerProcess

WAIT = 20.0


class Scene:
    """Two accounts: Alice's agent creates a channel in her org and adds Bob's agent, and sends
    three messages; she has a second channel in another org that Bob is not in."""

    def __init__(self, server: ServerProcess, api: Api, tmp_path: Path) -> None:
        self.alice = api.signup(name="Alice")
        self.bob = api.signup(name="Bob")
        self.org = f"o{uuid.uuid4().hex[:10]}"
        self.other_org = f"p{uuid.uuid4().hex[:10]}"
        self.shared = f"{self.org}/team/chat"
        self.private = f"{self.other_org}/solo/notes"
        self.clients: list[StaticClient] = []
        alice = self._client(server, tmp_path, b"alice-agent", self.alice)
        bob = self._client(server, tmp_path, b"bob-agent", self.bob)
        shared = alice.create_channel(self.shared)
        joined = bob.join_channel(self.shared, shared.add_member(bob.generate_key_package()))
        for i in range(3):
            shared.send(b"hello %d" % i)
        for i in range(3):
            assert joined.receive(WAIT) == b"hello %d" % i
        alice.create_channel(self.private)

    def _client(
        self, server: ServerProcess, tmp_path: Path, identity: bytes, account: SignedUp
    ) -> StaticClient:
        client = StaticClient(
            server.relay_url,
            str(tmp_path / identity.decode()),
            identity,
            account.key,
            server.http_url,
        )
        self.clients.append(client)
        return client

    def close(self) -> None:
        for client in self.clients:
            client.close()


@pytest.fixture(scope="module")
def scene(
    shared_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Scene]:
    api = Api(shared_server.http_url)
    made = Scene(shared_server, api, tmp_path_factory.mktemp("agents"))
    try:
        yield made
    finally:
        made.close()
        api.close()


def _channels(api: Api, key: str, query: str = "") -> dict[str, Any]:
    response = api.http.get(f"/v1/channels{query}", headers=bearer(key))
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def _names(body: dict[str, Any]) -> list[str]:
    return [c["name"] for c in body["channels"]]


def test_an_account_sees_its_channels_with_their_rosters(api: Api, scene: Scene) -> None:
    body = _channels(api, scene.bob.key)
    assert _names(body) == [scene.shared]
    assert body["next_cursor"] is None
    channel = body["channels"][0]
    assert channel["epoch"] >= 1
    assert channel["member_count"] == 2
    assert channel["messages"] >= 3
    assert channel["retention"] == {"max_age_seconds": None, "max_entries": None, "max_bytes": None}
    last = datetime.fromisoformat(channel["last_activity_at"])
    assert abs(datetime.now(UTC) - last) < timedelta(minutes=5)
    roster = {m["identity"]: m for m in channel["members"]}
    assert set(roster) == {"alice-agent", "bob-agent"}
    assert roster["alice-agent"]["account"] == scene.alice.id
    assert roster["bob-agent"]["account"] == scene.bob.id
    assert all(m["bound"] for m in channel["members"])
    assert roster["bob-agent"]["identity_hex"] == b"bob-agent".hex()

    # Alice sees both of hers.
    assert sorted(_names(_channels(api, scene.alice.key))) == sorted([scene.shared, scene.private])


def test_an_account_without_members_sees_no_channel(api: Api, scene: Scene) -> None:
    stranger = api.signup()
    assert _channels(api, stranger.key) == {"channels": [], "next_cursor": None}


def test_the_key_patterns_limit_what_is_listed(api: Api, scene: Scene) -> None:
    limited = api.create_key(scene.alice.key, name="limited", channels=[f"{scene.org}/*/*"])
    assert _names(_channels(api, limited["key"])) == [scene.shared]
    elsewhere = api.create_key(scene.alice.key, name="elsewhere", channels=["nobody/*/*"])
    assert _names(_channels(api, elsewhere["key"])) == []
    # The rate counts only the channels the patterns match.
    rate = api.http.get("/v1/channels/rate", headers=bearer(elsewhere["key"])).json()
    assert rate["total"] == 0


def test_the_channels_scope_is_required(api: Api, scene: Scene) -> None:
    keys_only = api.create_key(scene.alice.key, name="keys only", scopes=["keys"])
    for path in ("/v1/channels", "/v1/channels/rate"):
        response = api.http.get(path, headers=bearer(keys_only["key"]))
        assert_error(response, 403, "api key lacks the channels scope")
        assert_error(api.http.get(path), 401, "missing authorization header")


def test_pages_follow_the_cursor(api: Api, scene: Scene) -> None:
    first = _channels(api, scene.alice.key, "?limit=1")
    assert len(first["channels"]) == 1
    assert first["next_cursor"] is not None
    second = _channels(api, scene.alice.key, f"?limit=1&cursor={first['next_cursor']}")
    seen = _names(first) + _names(second)
    if second["next_cursor"] is not None:
        seen += _names(_channels(api, scene.alice.key, f"?limit=1&cursor={second['next_cursor']}"))
    assert sorted(seen) == sorted([scene.shared, scene.private])


@pytest.mark.parametrize(
    ("query", "text"),
    [
        ("?limit=0", "limit must be an integer between 1 and 50"),
        ("?limit=51", "limit must be an integer between 1 and 50"),
        ("?limit=x", "limit must be an integer between 1 and 50"),
        ("?cursor=abc", "invalid cursor"),
        ("?cursor=1&cursor=2", "limit and cursor may each be given once"),
    ],
)
def test_bad_queries_are_refused(api: Api, scene: Scene, query: str, text: str) -> None:
    response = api.http.get(f"/v1/channels{query}", headers=bearer(scene.alice.key))
    assert_error(response, 400, text)


def test_the_rate_counts_the_accounts_messages_per_minute(api: Api, scene: Scene) -> None:
    response = api.http.get("/v1/channels/rate", headers=bearer(scene.alice.key))
    assert response.status_code == 200, response.text
    rate = response.json()
    assert len(rate["per_minute"]) == 60
    assert rate["minute_seconds"] == 60
    # Alice sent three application messages just now (the commits are not counted); Bob none.
    assert rate["total"] == sum(rate["per_minute"]) == 3
    start = datetime.fromisoformat(rate["start"])
    assert timedelta(minutes=58) < datetime.now(UTC) - start < timedelta(minutes=61)
    bobs = api.http.get("/v1/channels/rate", headers=bearer(scene.bob.key)).json()
    assert bobs["total"] == 0


async def test_without_a_relay_the_reads_are_unavailable(tmp_path: Path) -> None:
    # The HTTP app alone (no relay in its process): a clear 503, never a 500.
    async with (
        open_database(f"sqlite:///{tmp_path / 'static.db'}") as db,
        open_authority(db, ServerSettings().api) as authority,
    ):
        app = create_app(db, ServerSettings(), authority)
        client = app.test_client()
        signup = await client.post("/v1/accounts", json={"email": "a@example.com"})
        key = (await signup.get_json())["api_key"]
        for path in ("/v1/channels", "/v1/channels/rate"):
            response = await client.get(path, headers=bearer(key))
            assert response.status_code == 503
            assert await response.get_json() == {"error": "relay is not running"}
