"""API keys: token exchange at creation, refresh across expiry, revocation, account scoping."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from static._api_client import TokenSource
from static_sdk import AuthError, StaticClient, TransportError
from tests.sdk.conftest import WAIT, Clients, channel_name, read_to_end
from tests.support.api import Api
from tests.support.server import ServerProcess, free_port


@pytest.fixture
def authed(start_server: Callable[..., ServerProcess]) -> ServerProcess:
    """A server that requires tokens, minting them with a 2 s lifetime."""
    return start_server("--token-ttl", "2")


def test_api_key_flow_with_token_refresh_across_expiry(
    authed: ServerProcess, api: Api, clients: Clients
) -> None:
    account = api.signup()
    second = api.create_key(account.key, name="bob")["key"]
    alice = clients(authed, b"alice", api_key=account.key, api_url=authed.http_url)
    bob = clients(authed, b"bob", api_key=second, api_url=authed.http_url)
    name = channel_name()
    alices = alice.create_channel(name)
    bobs = bob.join_channel(name, alices.add_member(bob.generate_key_package()))
    # Spans three token lifetimes: sends refresh ahead of expiry, Bob's stream is ended by the
    # relay with UNAUTHENTICATED at expiry and resumes by itself.
    for i in range(12):
        alices.send(b"m%d" % i)
        assert bobs.receive(WAIT) == b"m%d" % i
        time.sleep(0.5)
    bobs.send(b"done")
    assert alices.receive(WAIT) == b"done"


def test_bad_key_and_revoked_key(authed: ServerProcess, api: Api, clients: Clients) -> None:
    with pytest.raises(AuthError, match=r"^auth error: .*invalid or revoked api key"):
        clients(authed, b"x", api_key="sk_live_" + "0" * 40, api_url=authed.http_url)
    account = api.signup()
    second = api.create_key(account.key, name="bob")
    alice = clients(authed, b"alice", api_key=account.key, api_url=authed.http_url)
    bob = clients(authed, b"bob", api_key=second["key"], api_url=authed.http_url)
    name = channel_name()
    alices = alice.create_channel(name)
    bobs = bob.join_channel(name, alices.add_member(bob.generate_key_package()))
    assert api.revoke(account.key, second["id"]).status_code == 204
    # Bob's stream is ended, the refresh is refused: his iterator raises the auth error.
    with pytest.raises(AuthError, match=r"^auth error: "):
        read_to_end(bobs.messages())
    with pytest.raises(AuthError, match=r"^auth error: "):
        bobs.send(b"no")
    alices.send(b"alice still works")


def test_anonymous_client_on_a_server_that_requires_tokens(
    authed: ServerProcess, clients: Clients
) -> None:
    with pytest.raises(AuthError, match=r"^auth error: .*api_key"):
        clients(authed, b"anon").create_channel(channel_name())


def test_agents_of_two_accounts_share_a_channel(
    authed: ServerProcess, api: Api, clients: Clients
) -> None:
    """The spec's typical flow with agent B holding its own account's key: access follows MLS
    membership, not the account that created the channel."""
    one, two = api.signup(), api.signup()
    alice = clients(authed, b"alice", api_key=one.key, api_url=authed.http_url)
    bob = clients(authed, b"bob", api_key=two.key, api_url=authed.http_url)
    alices = alice.create_channel(channel_name())
    bobs = bob.join_channel(alices.name, alices.add_member(bob.generate_key_package()))
    alices.send(b"from a")
    got = bobs.receive_message(WAIT)
    assert (got.payload, got.sender, got.account) == (b"from a", b"alice", one.id)
    bobs.send(b"from b")
    got = alices.receive_message(WAIT)
    assert (got.payload, got.sender, got.account) == (b"from b", b"bob", two.id)
    roster = {m.identity: m.account for m in alices.roster()}
    assert roster == {b"alice": one.id, b"bob": two.id}
    # The org belongs to the first account that created a channel under it.
    org = alices.name.split("/")[0]
    with pytest.raises(AuthError, match=rf"^auth error: .*org '{org}' belongs to another account"):
        bob.create_channel(f"{org}/other/channel")
    # Nothing is left behind by the refused create.
    assert bob.channels() == [alices.name]
    assert bob.create_channel("bobs-org/x/y").name == "bobs-org/x/y"


def test_token_endpoint_is_not_the_relay(authed: ServerProcess, tmp_path: object) -> None:
    # api_url pointing at something that is not the API answers 404: a transport error.
    with pytest.raises(TransportError, match=r"^transport error: "):
        StaticClient(
            authed.relay_url,
            f"{tmp_path}/x",
            b"x",
            api_key="sk_live_abc",
            api_url=authed.http_url + "/nothing-here",
        )


def test_a_key_read_from_a_file_works_and_no_error_shows_a_key(
    authed: ServerProcess, api: Api, clients: Clients, tmp_path: Path
) -> None:
    """A key read from a file keeps its newline: it is stripped, and the client works. A key
    that is wrong inside, or one the API cannot be asked about, fails with an error that never
    quotes it (nor does any repr)."""
    account = api.signup()
    (tmp_path / "key").write_text(account.key + "\n")
    for read in [(tmp_path / "key").read_text(), f"  {account.key}\r\n", f"\t{account.key} "]:
        client = clients(authed, b"alice", api_key=read, api_url=authed.http_url)
        assert account.key not in repr(client)
        client.create_channel(channel_name()).send(b"with a key from a file")
        client.close()
    secret = account.key
    unreachable = f"http://127.0.0.1:{free_port()}"
    attempts: list[tuple[type[Exception], str, str]] = [
        (AuthError, secret + "\nsk_live_second_key", authed.http_url),  # two keys, one value
        (AuthError, secret[:20] + " " + secret[20:], authed.http_url),
        (AuthError, secret + "\x00", authed.http_url),
        (AuthError, secret + "é", authed.http_url),
        (AuthError, "\n", authed.http_url),
        (TransportError, secret + "\n", unreachable),
        # Refused by the API (another last character: "x" was the key's own 1 time in 62).
        (AuthError, secret[:-1] + ("y" if secret.endswith("x") else "x"), authed.http_url),
    ]
    for error, key, url in attempts:
        with pytest.raises(error) as info:
            StaticClient(authed.relay_url, tmp_path / "x", b"x", api_key=key, api_url=url)
        shown = f"{info.value} {info.value!r} {info.value.__cause__!r} {info.value.__context__!r}"
        assert secret not in shown and secret[8:24] not in shown, shown
    assert secret not in repr(TokenSource(authed.http_url, secret))


def test_revoking_the_key_under_a_live_client_fails_its_next_send_and_flush(
    authed: ServerProcess, api: Api, clients: Clients
) -> None:
    """The relay ends the client's PublishBatches call when its key is revoked (as it ends its
    subscriptions), the token refresh is refused: the next send() and flush() raise the auth
    error, and nothing more is accepted."""
    account = api.signup()
    doomed = api.create_key(account.key, name="doomed")
    alice = clients(authed, b"alice", api_key=doomed["key"], api_url=authed.http_url)
    channel = alice.create_channel(channel_name())
    channel.send(b"before")
    channel.send_pipelined(b"before, pipelined")
    channel.flush(WAIT)
    assert api.revoke(account.key, doomed["id"]).status_code == 204
    # The relay's revocation checks run every 0.5 s.
    time.sleep(1.5)
    with pytest.raises(AuthError, match=r"^auth error: "):
        channel.send(b"after")
    try:
        channel.send_pipelined(b"after, pipelined")
    except AuthError as refused:  # the channel has ended already: refused at once
        assert str(refused).startswith("auth error: ")
    else:
        with pytest.raises(AuthError, match=r"^auth error: "):
            channel.flush(WAIT)
