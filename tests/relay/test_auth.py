"""The relay with real credentials: API keys exchanged for JWTs at POST /v1/tokens."""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
import pytest

from tests.relay import mls_vectors as mls
from tests.relay.client import Member, Relay, pb, status_of
from tests.support.api import Api
from tests.support.server import ServerProcess

CHANNEL = "acme/agents/chat"
Start = Callable[..., ServerProcess]
NO_LIMITS = ("--signup-rate", "off", "--key-rate", "off")


def _key_id(api: Api, key: str) -> str:
    (only,) = [k for k in api.keys(key) if key.startswith(k["key_prefix"])]
    return str(only["id"])


def test_jwt_access_and_account_scoped_channels(start_server: Start) -> None:
    """A channel is reached by the accounts bound to its members. The premise changed: another
    account's channel was NOT_FOUND and names were per account; now it is PERMISSION_DENIED,
    names are global (ALREADY_EXISTS) and the org belongs to the account that claimed it."""
    server = start_server(*NO_LIMITS)
    api = Api(server.http_url)
    alice, bob = api.signup(), api.signup()
    with Relay(server.relay_url, api.token(alice.key)) as relay_a:
        relay_a.create(CHANNEL)
        assert relay_a.publish(CHANNEL, mls.application(CHANNEL, 0)).seq == 1
        # A second agent (key) of the same account shares the account's channels.
        second_key = api.create_key(alice.key, name="agent-2")["key"]
        with Relay(server.relay_url, api.token(second_key)) as relay_a2:
            assert [e.seq for e in relay_a2.subscribe(CHANNEL).wait_for(1)] == [1]
            with pytest.raises(grpc.RpcError) as exists:
                relay_a2.create(CHANNEL)  # one channel per name, whoever asks
            assert status_of(exists.value)[0] == grpc.StatusCode.ALREADY_EXISTS
    with Relay(server.relay_url, api.token(bob.key)) as relay_b:
        with pytest.raises(grpc.RpcError) as hidden:
            relay_b.publish(CHANNEL, mls.application(CHANNEL, 0))
        assert status_of(hidden.value)[0] == grpc.StatusCode.PERMISSION_DENIED
        # Bob gets no channel of that name (names are global), nor any under Alice's org.
        for name in (CHANNEL, "acme/bob/chat"):
            with pytest.raises(grpc.RpcError) as claimed:
                relay_b.create(name)
            code, details, _ = status_of(claimed.value)
            assert code == grpc.StatusCode.PERMISSION_DENIED
            assert "org 'acme' belongs to another account" in details
        relay_b.create("bobco/agents/chat")
        assert (
            relay_b.publish("bobco/agents/chat", mls.application("bobco/agents/chat", 0)).seq == 1
        )
    # An API key itself is not a relay credential, nor is a tampered token.
    token = api.token(alice.key)
    for bad in (alice.key, token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")):
        with Relay(server.relay_url, bad) as relay:
            with pytest.raises(grpc.RpcError) as refused:
                relay.create_raw("acme/agents/other")
            assert status_of(refused.value)[0] == grpc.StatusCode.UNAUTHENTICATED
    api.close()


def test_revoking_the_key_ends_its_streams_within_a_second(start_server: Start) -> None:
    server = start_server(*NO_LIMITS)
    api = Api(server.http_url)
    owner = api.signup()
    doomed_key = api.create_key(owner.key, name="doomed")["key"]
    with (
        Relay(server.relay_url, api.token(doomed_key)) as doomed,
        Relay(server.relay_url, api.token(owner.key)) as other,
    ):
        doomed.create(CHANNEL)
        sub = doomed.subscribe(CHANNEL)
        bystander = other.subscribe(CHANNEL)
        sub.wait_keepalives(1)
        bystander.wait_keepalives(1)
        revoked_at = time.monotonic()
        assert api.revoke(owner.key, _key_id(api, doomed_key)).status_code == 204
        error = sub.wait_end(timeout=5)
        elapsed = time.monotonic() - revoked_at
        assert error is not None
        code, details, _ = status_of(error)
        assert code == grpc.StatusCode.UNAUTHENTICATED and "revoked" in details
        assert elapsed < 1.5, f"the stream ended {elapsed:.2f}s after the revocation"
        with pytest.raises(grpc.RpcError) as refused:
            doomed.publish(CHANNEL, mls.application(CHANNEL, 0))
        assert status_of(refused.value)[0] == grpc.StatusCode.UNAUTHENTICATED
        # The account's other key is untouched.
        assert other.publish(CHANNEL, mls.application(CHANNEL, 0)).seq == 1
        assert [e.seq for e in bystander.wait_for(1)] == [1]
        bystander.cancel()
    api.close()


def test_an_expired_token_ends_the_stream(start_server: Start) -> None:
    server = start_server(*NO_LIMITS, "--token-ttl", "2")
    api = Api(server.http_url)
    owner = api.signup()
    token = api.token(owner.key)
    issued = time.monotonic()
    with Relay(server.relay_url, token) as relay:
        relay.create(CHANNEL)
        sub = relay.subscribe(CHANNEL)
        sub.wait_keepalives(1)
        error = sub.wait_end(timeout=6)
        assert error is not None
        code, details, _ = status_of(error)
        assert code == grpc.StatusCode.UNAUTHENTICATED and "expired" in details
        assert time.monotonic() - issued < 4
        with pytest.raises(grpc.RpcError) as refused:
            list(
                relay.stub.Subscribe(
                    pb.SubscribeRequest(channel=CHANNEL), timeout=5, metadata=relay.metadata
                )
            )
        assert status_of(refused.value)[0] == grpc.StatusCode.UNAUTHENTICATED
    # A fresh token resumes where the stream stopped.
    with Relay(server.relay_url, api.token(owner.key)) as relay:
        assert relay.publish(CHANNEL, mls.application(CHANNEL, 0)).seq == 1
    api.close()


@pytest.mark.parametrize(
    "header",
    [
        lambda token: [("authorization", f"Basic {token}")],
        lambda token: [("authorization", "Bearer")],
        lambda token: [("authorization", f"Bearer {token} {token}")],
        lambda token: [("authorization", f"Bearer {token}" + "x" * 9000)],
        lambda token: [("authorization", f"Bearer {token}")] * 2,
    ],
    ids=["basic", "no-token", "two-tokens", "oversized", "two-headers"],
)
def test_malformed_authorization_is_refused(
    start_server: Start, header: Callable[[str], list[tuple[str, str]]]
) -> None:
    # Each is refused, even around a valid token; the token alone is accepted.
    server = start_server()
    api = Api(server.http_url)
    token = api.token(api.signup().key)
    with Relay(server.relay_url, token) as relay:
        group = Member(relay)
        group.engine.create_group(CHANNEL)
        state = group.engine.public_state(CHANNEL)
        with pytest.raises(grpc.RpcError) as refused:
            relay.create_raw(CHANNEL, *state, group.binding(CHANNEL), metadata=header(token))
        assert status_of(refused.value)[0] == grpc.StatusCode.UNAUTHENTICATED
        group.close()
    with Relay(server.relay_url, token) as relay:
        assert relay.create(CHANNEL).epoch == 0
    api.close()
