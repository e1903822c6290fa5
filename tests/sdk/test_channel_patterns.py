"""Keys restricted to channel patterns (issue 30): the relay refuses a channel outside them, and
the SDK says so as an auth error naming the patterns. Needs POST /v1/keys' ``channels`` (the
HTTP side of issue 30): skipped on a server without it."""

from __future__ import annotations

import uuid

import pytest

from static_sdk import AuthError
from tests.sdk.conftest import WAIT, Clients
from tests.support.api import Api
from tests.support.server import ServerProcess


def test_a_scoped_key_reaches_only_its_channels(
    authed: ServerProcess, api: Api, clients: Clients
) -> None:
    account = api.signup()
    org = f"o{uuid.uuid4().hex[:10]}"
    created = api.create_key(account.key, name="ops agent", channels=[f"{org}/ops/*"])
    if created.get("channels") != [f"{org}/ops/*"]:
        pytest.skip("this server's POST /v1/keys has no channel patterns yet")
    agent = clients(authed, b"agent", api_key=created["key"], api_url=authed.http_url)
    outside = f"{org}/billing/chat"
    expected = rf"^auth error: .*channel {outside} is outside this key's channels \({org}/ops/\*\)$"
    with pytest.raises(AuthError, match=expected):
        agent.create_channel(outside)
    # Inside its patterns the key works as any: a member joins with the account's full key.
    inside = agent.create_channel(f"{org}/ops/chat")
    full = clients(authed, b"full", api_key=account.key, api_url=authed.http_url)
    joined = full.join_channel(f"{org}/ops/chat", inside.add_member(full.generate_key_package()))
    inside.send(b"hello")
    assert joined.receive(WAIT) == b"hello"
