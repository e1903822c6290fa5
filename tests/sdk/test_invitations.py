"""Agents meet through the service: addresses, the key-package directory, invitations with
consent (docs/sdk.md, Invitations). Real server, real clients, two accounts."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import pytest
import trio

from static_sdk import Address, AuthError, Channel, Invitation, StaticClient
from tests.sdk.conftest import WAIT, Clients, channel_name, within
from tests.support.api import Api, SignedUp
from tests.support.server import ServerProcess

NO_SUCH_ADDRESS = "no such address, or it does not accept invitations from this account"


def refused(address: str) -> str:
    """The one refusal of an invite, whether the address is unknown or does not allow us."""
    return "^" + re.escape(f"auth error: cannot invite {address}: {NO_SUCH_ADDRESS}") + "$"


def agent(
    clients: Clients, server: ServerProcess, identity: bytes, account: SignedUp
) -> StaticClient:
    return clients(server, identity, api_key=account.key, api_url=server.http_url)


def next_invitation(client: StaticClient) -> Invitation[Channel]:
    return within(lambda: next(client.invitations()), "an invitation")


def test_two_accounts_meet_without_a_side_channel(
    authed: ServerProcess, api: Api, clients: Clients
) -> None:
    one, two = api.signup(), api.signup()
    alice, bob = agent(clients, authed, b"alice", one), agent(clients, authed, b"bob", two)
    # The address names the account and the identity; it parses back.
    assert Address.parse(bob.address) == Address(two.id, b"bob")
    assert str(Address.parse(bob.address)) == bob.address
    bob.allow_invitations([one.id])
    alices = alice.create_channel(channel_name())
    alices.invite(bob.address)
    invitation = next_invitation(bob)
    assert (invitation.channel, invitation.inviter, invitation.inviter_account) == (
        alices.name,
        b"alice",
        one.id,
    )
    assert invitation.expires_at > time.time()
    bobs = invitation.accept()
    alices.send(b"hello bob")
    got = bobs.receive_message(WAIT)
    assert (got.payload, got.sender, got.account) == (b"hello bob", b"alice", one.id)
    bobs.send(b"hello alice")
    assert alices.receive(WAIT) == b"hello alice"
    assert {m.identity: m.account for m in alices.roster()} == {b"alice": one.id, b"bob": two.id}
    # Accepted: not offered again.
    assert bob._native.list_invitations(0) == []


def test_by_default_only_the_own_account_may_invite(
    authed: ServerProcess, api: Api, clients: Clients
) -> None:
    one, two = api.signup(), api.signup()
    alice = agent(clients, authed, b"alice", one)
    bob = agent(clients, authed, b"bob", two)
    carol = agent(clients, authed, b"carol", two)
    iterator = bob.invitations()  # lists bob's packages; no policy: account two only
    alices = alice.create_channel(channel_name())
    started = time.monotonic()
    with pytest.raises(AuthError, match=refused(bob.address)):
        alices.invite(bob.address)
    # An unknown address gets the very same answer: the directory cannot be enumerated.
    unknown = str(Address(two.id, b"nobody"))
    with pytest.raises(AuthError, match=refused(unknown)):
        alices.invite(unknown)
    assert time.monotonic() - started < 4
    # Nothing was committed: the channel is still Alice's alone.
    assert alices.members() == [b"alice"]
    # An agent of Bob's own account may.
    carols = carol.create_channel(channel_name("carols-org"))
    carols.invite(bob.address)
    invitation = within(lambda: next(iterator), "carol's invitation")
    assert (invitation.inviter, invitation.inviter_account) == (b"carol", two.id)
    # Any account, once Bob says so.
    bob.allow_invitations(["*"])
    alices.invite(bob.address)
    assert within(lambda: next(iterator), "alice's invitation").inviter == b"alice"


def test_an_offline_agent_gets_its_invitation_on_its_next_run(
    authed: ServerProcess, api: Api, clients: Clients
) -> None:
    one = api.signup()
    alice = agent(clients, authed, b"alice", one)
    bob_dir = clients.tmp_path / "bob-state"
    bob = clients(authed, b"bob", data_dir=bob_dir, api_key=one.key, api_url=authed.http_url)
    address = bob.address
    bob.invitations()  # lists its key packages
    bob.close()
    alices = alice.create_channel(channel_name())
    alices.invite(address)
    alices.send(b"while you were away")
    bob = clients(authed, b"bob", data_dir=bob_dir, api_key=one.key, api_url=authed.http_url)
    bobs = next_invitation(bob).accept()
    assert bobs.receive(WAIT) == b"while you were away"


def test_a_declined_invitation_is_not_offered_again(
    authed: ServerProcess, api: Api, clients: Clients
) -> None:
    one = api.signup()
    alice, bob = agent(clients, authed, b"alice", one), agent(clients, authed, b"bob", one)
    iterator = bob.invitations()
    first, second = alice.create_channel(channel_name()), alice.create_channel(channel_name())
    first.invite(bob.address)
    declined = within(lambda: next(iterator), "the first invitation")
    declined.decline()
    second.invite(bob.address)
    # A fresh iterator starts from what is pending: only the second.
    invitation = next_invitation(bob)
    assert invitation.channel == second.name
    assert invitation.accept().name == second.name
    # The declined leaf stays in the first channel, unbound.
    assert {m.identity: m.account for m in first.roster()} == {b"alice": one.id, b"bob": None}


def test_the_iterators_end_when_the_client_closes(
    authed: ServerProcess, api: Api, clients: Clients
) -> None:
    one = api.signup()
    bob = agent(clients, authed, b"bob", one)
    iterator = bob.invitations()
    threading.Timer(0.5, bob.close).start()
    started = time.monotonic()
    assert within(lambda: list(iterator), "the iterator to end", 5) == []
    assert time.monotonic() - started < 3


def test_malformed_addresses_are_value_errors(relay: ServerProcess, clients: Clients) -> None:
    alice = clients(relay, b"alice")
    alices = alice.create_channel(channel_name())
    for bad in ["", "bob", "static:acct", "static:acct:***", "mailto:a:Ym9i"]:
        with pytest.raises(ValueError, match="invalid address"):
            alices.invite(bad)
    with pytest.raises(TypeError):
        Address.parse(b"static::Ym9i")  # type: ignore[arg-type]
    # Anonymous agents are one principal, the account "".
    assert alice.address == "static::YWxpY2U"


@pytest.mark.parametrize("flavour", ["trio", "asyncio"])
def test_invitations_async(authed: ServerProcess, api: Api, clients: Clients, flavour: str) -> None:
    one = api.signup()
    alice, bob = agent(clients, authed, b"alice", one), agent(clients, authed, b"bob", one)

    async def main() -> bytes:
        invitations = bob.invitations_async()
        await bob.allow_invitations_async([])
        alices = await alice.create_channel_async(channel_name())
        await alices.invite_async(await bob.address_async())
        invitation = await invitations.__anext__()
        bobs = await invitation.accept_async()
        await alices.send_async(b"async hello")
        return await bobs.receive_async()

    if flavour == "trio":

        async def bounded() -> bytes:
            with trio.fail_after(WAIT):
                return await main()

        assert trio.run(bounded) == b"async hello"
    else:
        assert asyncio.run(asyncio.wait_for(main(), WAIT)) == b"async hello"
