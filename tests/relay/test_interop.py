"""Interop: an SDK member (OpenMLS) and an mls-rs member (another RFC 9420 implementation,
publishing through raw gRPC) in one channel of a real ``static serve --allow-anonymous``, on
both store backends.

Anonymous callers are one principal (the account ""): the SDK creator's leaf is bound to it,
so the mls-rs member, which never binds its own leaf, reaches the channel through it. What is
checked: each side's messages reach the other; each side's commits (PublicMessages, as both
send them) pass the relay's handshake checks against the channel's public group state and are
applied by the other side; an mls-rs proposal is committed by reference by the SDK; and the
relay's refusals (stale epoch, a non-member's signature) hold for mls-rs output too.
"""

from __future__ import annotations

import importlib.util
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from static_sdk import Channel, StaticClient
from tests.relay.client import Relay, status_of
from tests.support.server import ServerProcess

if importlib.util.find_spec("mls_rs_uniffi") is None:  # the dev extra brings it
    if os.environ.get("CI"):
        pytest.fail("mls_rs_uniffi is not installed (the dev extra)", pytrace=False)
    pytest.skip("mls_rs_uniffi is not installed (the dev extra)", allow_module_level=True)

from tests.relay.interop_mlsrs import (
    APPLICATION,
    COMMIT,
    KEY_PACKAGE,
    PRIVATE_MESSAGE,
    PROPOSAL,
    PUBLIC_MESSAGE,
    WELCOME,
    MlsRsMember,
    outsider_commit,
    wire_format,
)

Start = Callable[..., ServerProcess]
WAIT = 10.0
MLS_RS = b"mls-rs"


@dataclass
class Pair:
    """An SDK member (``alice``, the creator) and an mls-rs member joined from her Welcome."""

    name: str
    server: ServerProcess
    sdk: StaticClient
    alice: Channel
    member: MlsRsMember
    key_package: bytes
    welcome: bytes
    #: The epoch the mls-rs member joined at (FetchWelcome's).
    joined_at: int


@pytest.fixture
def anon(start_server: Start) -> ServerProcess:
    return start_server("--allow-anonymous")


@pytest.fixture
def relay(anon: ServerProcess) -> Iterator[Relay]:
    with Relay(anon.relay_url) as client:
        yield client


@pytest.fixture
def opened(tmp_path: Path) -> Iterator[list[StaticClient]]:
    """SDK clients to close at the end."""
    clients: list[StaticClient] = []
    yield clients
    for client in clients:
        client.close()


@pytest.fixture
def pair(
    anon: ServerProcess, relay: Relay, opened: list[StaticClient], tmp_path: Path
) -> Iterator[Pair]:
    name = f"acme/i{uuid.uuid4().hex[:10]}/chan"
    sdk = StaticClient(anon.relay_url, tmp_path / "alice", b"alice")
    opened.append(sdk)
    alice = sdk.create_channel(name)
    member = MlsRsMember(MLS_RS, relay)
    key_package = member.key_package()
    welcome = alice.add_member(key_package)
    joined_at = member.join(name, welcome)
    try:
        yield Pair(name, anon, sdk, alice, member, key_package, welcome, joined_at)
    finally:
        member.close()


def wait_epoch(channel: Channel, epoch: int) -> None:
    deadline = time.monotonic() + WAIT
    while channel.epoch() < epoch and time.monotonic() < deadline:
        time.sleep(0.02)
    assert channel.epoch() == epoch


def test_mls_rs_joins_from_an_sdk_welcome_and_messages_go_both_ways(pair: Pair) -> None:
    assert wire_format(pair.key_package) == KEY_PACKAGE
    assert wire_format(pair.welcome) == WELCOME
    assert pair.joined_at == pair.alice.epoch() == 1
    # The relay's roster: the mls-rs leaf is there, unbound (it never sent a BindLeaf).
    assert [(m.identity, m.account, m.leaf_index) for m in pair.alice.roster()] == [
        (b"alice", "", 0),
        (MLS_RS, None, 1),
    ]
    message = pair.member.encrypt(b"hello from mls-rs")
    assert wire_format(message) == PRIVATE_MESSAGE
    published = pair.member.publish(message)
    assert published.epoch == 1
    got = pair.alice.receive_message(WAIT)
    assert (got.payload, got.sender, got.account) == (b"hello from mls-rs", MLS_RS, "")
    assert (got.seq, got.epoch) == (published.seq, 1)

    pair.alice.send(b"hello from the SDK")
    received = pair.member.receive()
    assert (received.kind, received.data) == ("application", b"hello from the SDK")
    assert received.sender != pair.member.signing_identity
    entry = pair.member.entries()[-1]
    assert (entry.seq, entry.epoch, entry.content_type) == (received.seq, 1, APPLICATION)


def test_an_mls_rs_commit_passes_the_relay_and_the_sdk_applies_it(pair: Pair) -> None:
    commit = pair.member.commit()
    assert wire_format(commit) == PUBLIC_MESSAGE  # mls-rs's default for handshakes
    published = pair.member.publish_commit(commit)
    assert published.epoch == 2
    wait_epoch(pair.alice, 2)
    assert pair.alice.members() == [b"alice", MLS_RS]

    pair.alice.send(b"at epoch 2")
    received = pair.member.receive()
    assert (received.kind, received.data) == ("application", b"at epoch 2")
    entries = pair.member.entries()
    assert [(e.epoch, e.content_type) for e in entries] == [(1, COMMIT), (2, APPLICATION)]

    pair.member.send(b"mls-rs at epoch 2")
    got = pair.alice.receive_message(WAIT)
    assert (got.payload, got.sender, got.epoch) == (b"mls-rs at epoch 2", MLS_RS, 2)


def test_an_sdk_commit_is_processed_by_mls_rs(pair: Pair) -> None:
    pair.alice.rotate_keys()
    assert pair.alice.epoch() == 2
    commit = pair.member.receive()
    assert (commit.kind, commit.applied) == ("commit", 0)
    assert commit.sender != pair.member.signing_identity
    pair.alice.send(b"after the rotation")
    received = pair.member.receive()
    assert (received.kind, received.data, received.sender) == (
        "application",
        b"after the rotation",
        commit.sender,
    )
    pair.member.send(b"mls-rs after the rotation")
    got = pair.alice.receive_message(WAIT)
    assert (got.payload, got.sender, got.epoch) == (b"mls-rs after the rotation", MLS_RS, 2)


def test_mls_rs_applies_an_sdk_add_commit_without_a_path(
    pair: Pair, opened: list[StaticClient], tmp_path: Path
) -> None:
    # The SDK's add commits carry no update path (docs/design.md, "Add commits without a
    # path"): the relay's public group and mls-rs accept them, and the epoch advances for all.
    carol_sdk = StaticClient(pair.server.relay_url, tmp_path / "carol", b"carol")
    opened.append(carol_sdk)
    welcome = pair.alice.add_member(carol_sdk.generate_key_package())
    added = pair.member.receive()
    assert (added.kind, added.applied) == ("commit", 1)
    carol = carol_sdk.join_channel(pair.name, welcome)
    assert pair.alice.epoch() == carol.epoch() == 2
    pair.member.send(b"mls-rs after a path-less add")
    for channel in (pair.alice, carol):
        got = channel.receive_message(WAIT)
        assert (got.payload, got.sender, got.epoch) == (b"mls-rs after a path-less add", MLS_RS, 2)
    carol.send(b"carol, added without a path")
    received = pair.member.receive()
    assert (received.kind, received.data) == ("application", b"carol, added without a path")


def test_mls_rs_adds_an_sdk_member_and_proposes_its_removal(
    pair: Pair, opened: list[StaticClient], tmp_path: Path
) -> None:
    carol_sdk = StaticClient(pair.server.relay_url, tmp_path / "carol", b"carol")
    opened.append(carol_sdk)
    # mls-rs commits the add; its Welcome goes with the commit, and the SDK joins from it.
    commit, welcome = pair.member.add(carol_sdk.generate_key_package())
    assert pair.member.publish_commit(commit, welcome).epoch == 2
    carol = carol_sdk.join_channel(pair.name, welcome)
    assert carol.epoch() == 2
    wait_epoch(pair.alice, 2)
    assert pair.alice.members() == carol.members() == [b"alice", MLS_RS, b"carol"]
    roster = [(m.identity, m.account) for m in carol.roster()]
    assert roster == [(b"alice", ""), (MLS_RS, None), (b"carol", "")]

    pair.member.send(b"welcome, carol")
    for channel in (pair.alice, carol):
        got = channel.receive_message(WAIT)
        assert (got.payload, got.sender, got.epoch) == (b"welcome, carol", MLS_RS, 2)
    carol.send(b"hi from carol")
    from_carol = pair.member.receive()
    assert (from_carol.kind, from_carol.data) == ("application", b"hi from carol")
    assert pair.alice.receive(WAIT) == b"hi from carol"

    # mls-rs proposes carol's removal (a PublicMessage proposal: the epoch stays); the SDK
    # commits it by reference, which the relay checks with the mls-rs proposal.
    proposal = pair.member.propose_remove(from_carol.sender)
    assert wire_format(proposal) == PUBLIC_MESSAGE
    assert pair.member.publish(proposal).epoch == 2
    removal = pair.member.receive()
    assert (removal.kind, removal.applied) == ("commit", 1)
    entries = pair.member.entries()
    assert [(e.epoch, e.content_type) for e in entries[-2:]] == [(2, PROPOSAL), (2, COMMIT)]
    wait_epoch(pair.alice, 3)
    assert pair.alice.members() == [b"alice", MLS_RS]
    with pytest.raises(EOFError):
        carol.receive(WAIT)
    pair.member.send(b"carol is gone")
    got = pair.alice.receive_message(WAIT)
    assert (got.payload, got.epoch) == (b"carol is gone", 3)


def test_a_stale_mls_rs_commit_is_fenced_then_retried(pair: Pair) -> None:
    stale = pair.member.commit()
    pair.alice.rotate_keys()  # wins epoch 1
    with pytest.raises(grpc.RpcError) as refused:
        pair.member.publish_commit(stale)
    code, details, trailers = status_of(refused.value)
    assert code == grpc.StatusCode.FAILED_PRECONDITION, details
    assert trailers["static-current-epoch"] == "2"
    # mls-rs catches up (its pending commit is dropped) and commits again.
    assert pair.member.receive().kind == "commit"
    assert pair.member.publish_commit(pair.member.commit()).epoch == 3
    wait_epoch(pair.alice, 3)
    pair.member.send(b"after the retry")
    assert pair.alice.receive(WAIT) == b"after the retry"


def test_a_commit_signed_by_an_outsider_is_refused(pair: Pair, relay: Relay) -> None:
    # Well formed and signed, for this group id and epoch, from "leaf 0": not alice's key.
    forged = outsider_commit(pair.name, b"alice", epoch=1)
    assert wire_format(forged) == PUBLIC_MESSAGE
    with pytest.raises(grpc.RpcError) as refused:
        relay.publish(pair.name, forged)
    code, details, _ = status_of(refused.value)
    assert code == grpc.StatusCode.PERMISSION_DENIED, details
    assert "the commit's signature does not verify" in details
    # Nothing moved: the members go on at epoch 1.
    assert pair.member.publish_commit(pair.member.commit()).epoch == 2
    wait_epoch(pair.alice, 2)


def test_a_private_message_commit_from_mls_rs_is_refused(pair: Pair, relay: Relay) -> None:
    commit = pair.member.commit()
    if wire_format(commit) != PRIVATE_MESSAGE:
        pytest.skip(
            "mls_rs_uniffi sends handshakes as PublicMessages only (its ClientConfig has no "
            "option to encrypt them)"
        )
    with pytest.raises(grpc.RpcError) as refused:
        relay.publish(pair.name, commit)
    code, details, _ = status_of(refused.value)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert "handshake messages must be PublicMessages" in details
