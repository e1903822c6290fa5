"""Channels governed by MLS membership, through the SDK: senders you can tell apart, identities
that are unique, the relay's attested roster, removal ending access."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from static_sdk import Channel, MLSEngineError, StaticError
from tests.conftest import BACKENDS
from tests.sdk.conftest import WAIT, Clients, channel_name, read_to_end
from tests.support.server import ServerProcess


def test_messages_with_their_sender_seq_and_epoch(relay: ServerProcess, clients: Clients) -> None:
    alices, bobs = clients.pair(relay)
    alices.send(b"one")
    alices.rotate_keys()
    alices.send(b"two")
    first, second = bobs.receive_message(WAIT), bobs.receive_message(WAIT)
    # Anonymous callers are one principal, the account "".
    assert (first.payload, first.sender, first.account, first.epoch) == (b"one", b"alice", "", 1)
    assert (second.payload, second.sender, second.epoch) == (b"two", b"alice", 2)
    assert second.seq > first.seq > 0
    # The spec's iterator still yields bytes; the other one yields Messages, in one order.
    bobs_messages = bobs.messages_with_sender()
    alices.send(b"three")
    assert next(bobs_messages).payload == b"three"
    alices.send(b"four")
    assert next(iter(bobs.messages())) == b"four"


def test_two_members_cannot_hold_one_identity(relay: ServerProcess, clients: Clients) -> None:
    alices, _ = clients.pair(relay)
    impostor = clients(relay, b"bob", data_dir=clients.tmp_path / "impostor")
    with pytest.raises(MLSEngineError, match=r"^MLS engine error: .*identity"):
        alices.add_member(impostor.generate_key_package())
    # Nothing was left pending: the channel goes on, and removing b"bob" removes one member.
    alices.send(b"still fine")
    alices.remove_member(b"bob")
    assert alices.members() == [b"alice"]
    assert [m.identity for m in alices.roster()] == [b"alice"]


def test_the_roster_is_the_relays_attestation(relay: ServerProcess, clients: Clients) -> None:
    alices, bobs = clients.pair(relay)
    carol = clients(relay, b"carol")
    welcome = alices.add_member(carol.generate_key_package())
    # Added but not joined: her leaf is in the group, bound to no account yet.
    roster = alices.roster()
    assert [(m.identity, m.account, m.leaf_index) for m in roster] == [
        (b"alice", "", 0),
        (b"bob", "", 1),
        (b"carol", None, 2),
    ]
    carols = carol.join_channel(alices.name, welcome)
    assert [m.account for m in bobs.roster()] == ["", "", ""]
    assert carols.members() == [b"alice", b"bob", b"carol"]


def test_removal_ends_the_removed_members_access(relay: ServerProcess, clients: Clients) -> None:
    alices, bobs = clients.pair(relay)
    alices.send(b"before")
    assert bobs.receive(WAIT) == b"before"
    alices.remove_member(b"bob")
    alices.send(b"after")
    # Bob's client learns of its removal from the commit and ends; it never sees "after".
    assert read_to_end(bobs.messages(), WAIT) == []
    # His state says he was removed: the removal's epoch, the roster without him.
    assert bobs.epoch() == alices.epoch()
    assert sorted(bobs.members()) == sorted(alices.members()) == [b"alice"]
    with pytest.raises(StaticError):
        bobs.send(b"no")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("away", ["offline", "online-not-reading"])
def test_a_removed_member_reads_what_came_before_its_removal(
    relay: ServerProcess, clients: Clients, tmp_path: Path, away: str
) -> None:
    """Bob is offline (or online, not reading) while Alice sends 3 messages and removes him:
    he reads the 3, then his iterator ends as at any removal. Before, the offline Bob could read
    nothing (a race, seen in the report): the relay's refusal after the entries it had sent (he
    is no longer a member) ended his channel before they were applied."""
    alice, bob = clients(relay, b"alice"), clients(relay, b"bob")
    name = channel_name()
    alices = alice.create_channel(name)
    bobs = bob.join_channel(name, alices.add_member(bob.generate_key_package()))
    if away == "offline":
        bob.close()
    sent = [b"one", b"two", b"three"]
    for payload in sent:
        alices.send(payload)
    alices.remove_member(b"bob")
    alices.send(b"after")
    if away == "offline":
        bobs = clients(relay, b"bob", data_dir=tmp_path / "agent-bob").open_channel(name)
    assert read_to_end(bobs.messages(), WAIT) == sent
    assert bobs.epoch() == alices.epoch()
    assert sorted(bobs.members()) == sorted(alices.members()) == [b"alice"]
    with pytest.raises(MLSEngineError, match="no longer a member"):
        bobs.send(b"no")


def test_members_rotating_keys_freely_all_get_through(
    relay: ServerProcess, clients: Clients
) -> None:
    """5 members each rotate their keys 50 times, all at once, as fast as they can: every
    commit races the others for its epoch; the member that just won steps aside and the
    members that lost most go first, so none gives up (before, 1-9 of 250 failed with "too
    busy: other members' commits won 16 times in a row"). All 250 land: the members end on one
    epoch, without a fork."""
    names = [b"alice", b"bob", b"carol", b"dave", b"erin"]
    agents = [clients(relay, n) for n in names]
    first = agents[0].create_channel(channel_name())
    channels = [first]
    for agent in agents[1:]:
        welcome = first.add_member(agent.generate_key_package())
        channels.append(agent.join_channel(first.name, welcome))
    start = first.epoch()
    failures: list[BaseException] = []
    barrier = threading.Barrier(len(channels))

    def rotate(channel: Channel) -> None:
        barrier.wait()
        for _ in range(50):
            try:
                channel.rotate_keys()
            except StaticError as exc:
                failures.append(exc)

    threads = [threading.Thread(target=rotate, args=(c,)) for c in channels]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "rotations still running after 120 s"
    assert failures == []
    deadline = time.monotonic() + WAIT
    while {c.epoch() for c in channels} != {start + 250}:
        assert time.monotonic() < deadline, [c.epoch() for c in channels]
        time.sleep(0.05)
    assert len({c.epoch_authenticator() for c in channels}) == 1
