"""Retention (docs/design.md §5.3, proto/relay.proto "Retention") against a real ``static serve``
process on both store backends: the org's owner sets a channel's policy, the relay's background
pruner applies it, and a reader from before the horizon gets OUT_OF_RANGE with the horizon (never
a hang or a gap), through raw gRPC and through the SDK. The server runs its pruner every 0.1 s with
no idempotency window, so nothing waits for long."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from static_sdk import StaticClient, TransportError
from tests.relay.client import Member, Relay, status_of
from tests.relay.test_subscribe_many import Many
from tests.support.api import Api
from tests.support.server import ServerProcess

CHANNEL = "acme/team/history"
Start = Callable[..., ServerProcess]
FAST = (
    "--signup-rate",
    "off",
    "--key-rate",
    "off",
    "--relay-prune-interval",
    "0.1",
    "--relay-idempotency-window",
    "0",
)


def pruned(horizon: int, position: str, channel: str = CHANNEL) -> str:
    return (
        f"channel '{channel}': its log up to seq {horizon} was pruned by its retention policy, so "
        f"it cannot be read {position}: a member this far behind must be added to the group again "
        "(a new Welcome)"
    )


def wait_horizon(relay: Relay, channel: str, horizon: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while (seen := relay.get_retention(channel).horizon_seq) != horizon:
        assert time.monotonic() < deadline, f"horizon {seen}, expected {horizon}"
        time.sleep(0.05)


class Accounts:
    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.api = Api(server.http_url)
        self.relays: list[Relay] = []

    def relay(self) -> Relay:
        relay = Relay(self.server.relay_url, self.api.token(self.api.signup().key))
        self.relays.append(relay)
        return relay

    def close(self) -> None:
        for relay in self.relays:
            relay.close()
        self.api.close()


@pytest.fixture
def accounts(start_server: Start) -> Iterator[Accounts]:
    made = Accounts(start_server(*FAST))
    yield made
    made.close()


def test_the_owner_sets_a_policy_and_old_cursors_are_out_of_range(accounts: Accounts) -> None:
    """The creator keeps 3 entries of 10: the background pruner moves the horizon to 7, and every
    read from before it is OUT_OF_RANGE with the horizon in its trailer; from the horizon on,
    the rest is served with no gap. Another account may neither set nor read the policy."""
    owner, outsider = accounts.relay(), accounts.relay()
    owner.create(CHANNEL)
    creator = owner.groups[CHANNEL].creator
    for i in range(10):
        creator.send(CHANNEL, f"message {i}".encode())
    got = owner.get_retention(CHANNEL)
    assert (got.horizon_seq, got.head_seq) == (0, 10)
    assert not got.channel_policy.HasField("max_entries")

    set_ = owner.set_retention(CHANNEL, max_entries=3)
    assert set_.channel_policy.max_entries == 3 and set_.effective.max_entries == 3
    wait_horizon(owner, CHANNEL, 7)

    sub = owner.subscribe(CHANNEL, after_seq=2)
    error = sub.wait_end()
    assert error is not None and sub.entries == []
    code, details, trailers = status_of(error)
    assert (code, details) == (grpc.StatusCode.OUT_OF_RANGE, pruned(7, "after seq 2"))
    assert trailers["static-horizon-seq"] == "7"
    epoch0 = owner.subscribe(CHANNEL, from_epoch=0)
    error = epoch0.wait_end()
    assert error is not None
    assert status_of(error)[:2] == (grpc.StatusCode.OUT_OF_RANGE, pruned(7, "from epoch 0"))

    rest = owner.subscribe(CHANNEL, after_seq=7)
    assert [e.seq for e in rest.wait_for(3)] == [8, 9, 10]
    rest.cancel()

    many = Many(owner)
    try:
        many.add(CHANNEL, after_seq=1)
        assert many.answer(CHANNEL) == (grpc.StatusCode.OUT_OF_RANGE, pruned(7, "after seq 1"))
    finally:
        many.cancel()

    owner_only = f"only the account owning the org of channel '{CHANNEL}' may set its retention"
    calls: list[Callable[[], object]] = [
        lambda: outsider.set_retention(CHANNEL, max_entries=1),
        lambda: outsider.get_retention(CHANNEL),
    ]
    for call in calls:
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert status_of(info.value)[:2] == (grpc.StatusCode.PERMISSION_DENIED, owner_only)
    assert owner.get_retention(CHANNEL).horizon_seq == 7


def test_an_unused_welcome_holds_the_log_until_its_joiner_binds(accounts: Accounts) -> None:
    """A Welcome's commit and what follows stay while its joiner has not bound its leaf; once it
    has (the Welcome used), the joiner reads from its epoch and the policy applies again."""
    alice_relay, bob_relay = accounts.relay(), accounts.relay()
    alice_relay.create(CHANNEL)
    alice = alice_relay.groups[CHANNEL].creator
    for i in range(3):
        alice.send(CHANNEL, f"before {i}".encode())
    bob = Member(bob_relay, "bob")
    try:
        commit, welcome = alice.engine.add_members(CHANNEL, [bob.engine.generate_key_package()])
        assert alice.publish_commit(CHANNEL, commit, welcome).seq == 4
        for i in range(4):
            alice.send(CHANNEL, f"after {i}".encode())
        alice_relay.set_retention(CHANNEL, max_entries=1)
        wait_horizon(alice_relay, CHANNEL, 4)
        time.sleep(0.3)  # passes go on: the Welcome holds the log at its commit
        assert alice_relay.get_retention(CHANNEL).horizon_seq == 4

        bob.engine.join_group(CHANNEL, welcome)
        assert bob.bind(CHANNEL).epoch == 1
        sub = bob_relay.subscribe(CHANNEL, from_epoch=1)
        assert [e.seq for e in sub.wait_for(4)] == [5, 6, 7, 8]
        sub.cancel()
        # Used: it goes after the server's grace (an hour), so the log stays for now.
        assert alice_relay.get_retention(CHANNEL).horizon_seq == 4
    finally:
        bob.close()


def test_the_sdk_says_its_history_was_pruned_and_how_to_rejoin(
    start_server: Start, tmp_path: Path
) -> None:
    """Bob's client is closed while Alice sends; the server's default policy keeps 2 entries
    (and Welcomes last half a second).
    Reopened, Bob's channel resumes after his last seq, below the horizon: receiving raises a
    TransportError that says the history was pruned and how to rejoin, at once (no hang)."""
    server = start_server(
        "--allow-anonymous",
        *FAST,
        "--relay-retention-max-entries",
        "2",
        # Bob's Welcome would hold the log for an hour after he used it.
        "--relay-welcome-ttl",
        "0.5",
    )
    alice = StaticClient(server.relay_url, tmp_path / "alice", b"alice")
    bob = StaticClient(server.relay_url, tmp_path / "bob", b"bob")
    try:
        alices = alice.create_channel("acme/sdk/history")
        bobs = bob.join_channel("acme/sdk/history", alices.add_member(bob.generate_key_package()))
        alices.send(b"hello")
        assert bobs.receive(timeout=10) == b"hello"
        bob.close()
        for i in range(6):
            alices.send(f"while bob was away {i}".encode())
        relay = Relay(server.relay_url)
        try:
            wait_horizon(relay, "acme/sdk/history", 6)
        finally:
            relay.close()

        bob = StaticClient(server.relay_url, tmp_path / "bob", b"bob")
        bobs = bob.open_channel("acme/sdk/history")
        started = time.monotonic()
        with pytest.raises(TransportError) as info:
            bobs.receive(timeout=10)
        assert time.monotonic() - started < 5
        text = str(info.value)
        assert text.startswith("transport error: Subscribe: the relay pruned"), text
        assert "up to seq 6" in text and "add it to the group again" in text, text
    finally:
        alice.close()
        bob.close()
