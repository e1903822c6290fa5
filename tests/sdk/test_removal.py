"""Revocation reaches the groups (docs/design.md §5.2, "Removal on revocation"): the relay, an
MLS external sender of each channel the SDK creates, proposes the removal of the leaves whose
binding's API key was revoked, and the remaining members' SDKs commit it at once."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from static_sdk import AuthError
from tests.sdk.conftest import WAIT, Clients, channel_name, read_to_end
from tests.support.api import Api
from tests.support.server import ServerProcess


def _until(check: Callable[[], bool], timeout: float = WAIT) -> float:
    """Seconds until ``check()`` held (fails the test past ``timeout``)."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout, "timed out"
        time.sleep(0.05)
    return time.monotonic() - started


def test_revoking_a_key_removes_its_agent_from_its_channels(
    authed: ServerProcess, api: Api, clients: Clients
) -> None:
    account = api.signup()
    second = api.create_key(account.key, name="bob")
    alice = clients(authed, b"alice", api_key=account.key, api_url=authed.http_url)
    bob = clients(authed, b"bob", api_key=second["key"], api_url=authed.http_url)
    alices = alice.create_channel(channel_name())
    bobs = bob.join_channel(alices.name, alices.add_member(bob.generate_key_package()))
    alices.send(b"hello")
    assert bobs.receive(WAIT) == b"hello"
    epoch = alices.epoch()
    assert api.revoke(account.key, second["id"]).status_code == 204
    # Within a removal pass (2 s) and a commit: alice's SDK committed the relay's proposal.
    took = _until(lambda: alices.members() == [b"alice"])
    assert took < 5.0, took
    assert alices.epoch() == epoch + 1
    assert [m.identity for m in alices.roster()] == [b"alice"]
    # Bob's key is revoked: his iterator ends with the auth error.
    with pytest.raises(AuthError, match=r"^auth error: "):
        read_to_end(bobs.messages())
    alices.send(b"alice still works")


def test_a_leaf_bound_again_with_a_rolled_key_stays(
    authed: ServerProcess, api: Api, clients: Clients
) -> None:
    """Bob restarts with a new key of his account: his SDK binds his leaf again with it, so
    revoking the old key removes nothing."""
    account = api.signup()
    old = api.create_key(account.key, name="bob")
    alice = clients(authed, b"alice", api_key=account.key, api_url=authed.http_url)
    bob = clients(authed, b"bob", api_key=old["key"], api_url=authed.http_url)
    alices = alice.create_channel(channel_name())
    bob.join_channel(alices.name, alices.add_member(bob.generate_key_package()))
    bob.close()
    new = api.create_key(account.key, name="bob, rolled")
    bob = clients(authed, b"bob", api_key=new["key"], api_url=authed.http_url)
    bobs = bob.open_channel(alices.name)
    # The SDK binds the leaf again in the background as the channel opens.
    time.sleep(1.0)
    epoch = alices.epoch()
    assert api.revoke(account.key, old["id"]).status_code == 204
    # Two removal passes and more: nothing was proposed.
    time.sleep(5.0)
    assert sorted(alices.members()) == [b"alice", b"bob"]
    assert alices.epoch() == epoch
    alices.send(b"still here?")
    assert bobs.receive(WAIT) == b"still here?"
