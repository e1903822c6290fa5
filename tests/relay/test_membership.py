"""Channels governed by MLS membership (docs/design.md §5.2, proto/relay.proto "Membership"),
against a real ``static serve`` process on both store backends, with real MLS members.

Each test fails if its rule were not enforced: an outsider that could read, publish or list
members, a forged or PrivateMessage commit that was logged or moved the epoch, a removed
account that kept reading, another account's org that could be claimed."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from tests.relay import mls_vectors as mls
from tests.relay.client import Group, Member, Relay, account_of, pb, status_of
from tests.relay.test_subscribe_many import Many
from tests.support.api import Api
from tests.support.server import ServerProcess

CHANNEL = "acme/team/chat"
Start = Callable[..., ServerProcess]
NO_LIMITS = ("--signup-rate", "off", "--key-rate", "off")
DENIED = grpc.StatusCode.PERMISSION_DENIED


def not_a_member(channel: str) -> str:
    return (
        f"this account is not a member of channel '{channel}' (no leaf of its group is bound to it)"
    )


def refusal(call: Callable[..., object], *args: Any) -> tuple[grpc.StatusCode, str]:
    """The status ``call(*args)`` fails with."""
    with pytest.raises(grpc.RpcError) as info:
        call(*args)
    code, details, _ = status_of(info.value)
    return code, details


def create_refusal(relay: Relay, channel: str) -> tuple[grpc.StatusCode, str]:
    """The status creating ``channel`` from a new member's real group fails with."""
    member = Member(relay)
    try:
        return refusal(member.create, channel)
    finally:
        member.close()


def subscribe_refusal(relay: Relay, channel: str) -> tuple[grpc.StatusCode, str]:
    """The status a Subscribe of ``channel`` ends with at once, with no entry."""
    sub = relay.subscribe(channel)
    error = sub.wait_end()
    assert error is not None and sub.entries == []
    code, details, _ = status_of(error)
    return code, details


class Accounts:
    """A server with accounts, each with a relay connection acting for it."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.api = Api(server.http_url)
        self.relays: list[Relay] = []

    def relay(self, key: str | None = None) -> Relay:
        """A connection for a new account (``key``: for that key's account; anonymous when the
        server allows it and key is "")."""
        if key is None:
            key = self.api.signup().key
        relay = Relay(self.server.relay_url, self.api.token(key) if key else None)
        self.relays.append(relay)
        return relay

    def close(self) -> None:
        for relay in self.relays:
            relay.close()
        self.api.close()


@pytest.fixture
def accounts(start_server: Start) -> Iterator[Accounts]:
    made = Accounts(start_server(*NO_LIMITS))
    yield made
    made.close()


def log_of(relay: Relay, channel: str, count: int) -> list[Any]:
    """The first ``count`` entries of the channel's log, read by ``relay``."""
    sub = relay.subscribe(channel)
    entries = sub.wait_for(count)
    sub.cancel()
    return entries


def test_a_member_of_another_account_reads_and_publishes(accounts: Accounts) -> None:
    """B joins A's channel from A's Welcome and binds its leaf: both then publish and read, each
    decrypts the other, ListMembers attests both accounts, and each entry names its publisher."""
    relay_a, relay_b = accounts.relay(), accounts.relay()
    a_id, b_id = relay_a.account, relay_b.account
    assert a_id and b_id and a_id != b_id
    relay_a.create(CHANNEL)
    group = relay_a.groups[CHANNEL]
    alice = group.creator
    # B's agent joins by hand to see the binding matter: until it binds, B has no access.
    bob = Member(relay_b, "bob")
    key_package = bob.engine.generate_key_package()
    commit, welcome = alice.engine.add_members(CHANNEL, [key_package])
    assert alice.publish_commit(CHANNEL, commit, welcome).epoch == 1
    bob.engine.join_group(CHANNEL, welcome)
    assert refusal(lambda: relay_b.publish(CHANNEL, mls.application(CHANNEL, 1))) == (
        DENIED,
        not_a_member(CHANNEL),
    )
    assert bob.bind(CHANNEL).epoch == 1
    group.members.append(bob)
    # Both publish real messages; each reads the log and decrypts the other's.
    assert alice.send(CHANNEL, b"hello bob").seq == 2
    assert bob.send(CHANNEL, b"hello alice").seq == 3
    on_b, on_a = log_of(relay_b, CHANNEL, 3), log_of(relay_a, CHANNEL, 3)
    assert [e.message for e in on_a] == [e.message for e in on_b]
    assert bob.apply(CHANNEL, on_b[1].message).payload == b"hello bob"
    assert alice.apply(CHANNEL, on_a[2].message).payload == b"hello alice"
    assert [e.account for e in on_a] == [a_id, a_id, b_id]  # the relay's attestation
    # Both accounts list the members, each leaf with its account.
    for relay in (relay_a, relay_b):
        listed = relay.list_members(CHANNEL)
        assert listed.epoch == 1
        assert [(m.leaf_index, m.identity, m.account) for m in listed.members] == [
            (0, alice.identity, a_id),
            (1, bob.identity, b_id),
        ]
    # B fetches its Welcome (members only), and B commits too: A applies it.
    ref = mls.key_package_ref(key_package)
    assert relay_b.fetch_welcome(CHANNEL, ref=ref).welcome == welcome
    assert group.commit(by=bob).epoch == 2
    assert alice.send(CHANNEL, b"after bob's commit").epoch == 2
    bob.close()


def test_an_outsider_is_refused(accounts: Accounts) -> None:
    """An account with no bound leaf reads, publishes, fetches, lists and binds nothing, and
    cannot create under another account's org; it learns only that the channel exists."""
    relay_a, outsider = accounts.relay(), accounts.relay()
    relay_a.create(CHANNEL)
    group = relay_a.groups[CHANNEL]
    group.add([Relay(relay_a.url, relay_a.token)])  # a Welcome to fetch
    ref = mls.key_package_ref(group.key_packages[0])
    denied = (DENIED, not_a_member(CHANNEL))
    assert refusal(lambda: outsider.publish(CHANNEL, mls.application(CHANNEL, 1))) == denied
    assert subscribe_refusal(outsider, CHANNEL) == denied
    assert refusal(lambda: outsider.fetch_welcome(CHANNEL, ref=ref)) == denied
    assert refusal(lambda: outsider.list_members(CHANNEL)) == denied
    [batch] = outsider.publish_batches(
        [[pb.PublishRequest(channel=CHANNEL, message=mls.application(CHANNEL, 1))]]
    )
    assert (batch.results[0].refused.code, batch.results[0].refused.message) == (
        DENIED.value[0],
        not_a_member(CHANNEL),
    )
    many = Many(outsider)
    many.add(CHANNEL)
    assert many.answer(CHANNEL) == denied
    many.cancel()
    # A binding is for the account whose token sent it: the creator's proof, replayed with
    # the outsider's token, binds nothing; nor does the outsider's own leaf-0 proof.
    proof = group.creator.binding(CHANNEL)
    code, _ = refusal(lambda: outsider.bind(CHANNEL, proof))
    assert code == DENIED
    assert refusal(lambda: outsider.list_members(CHANNEL)) == denied
    # The org is A's: the outsider may not create under it, named or not; its own org is free.
    for name in ("acme/other/chat", CHANNEL):
        code, details = create_refusal(outsider, name)
        assert code == DENIED and "org 'acme' belongs to another account" in details
    assert outsider.create("outsiders/x/chat").epoch == 0
    # Nothing the outsider did reached the log: A's next entries follow A's add.
    assert group.creator.send(CHANNEL, b"still ours").seq == 2
    assert [e.account for e in log_of(relay_a, CHANNEL, 2)] == [relay_a.account] * 2


def _private_commit(channel: str, epoch: int, n: int) -> bytes:
    """A well-framed PrivateMessage commit (content encrypted, as a member's would be)."""
    return mls.private_message(channel, epoch, mls.COMMIT, b"encrypted commit %d" % n + bytes(64))


def test_forged_and_private_commits_are_refused_without_moving_the_epoch(
    accounts: Accounts,
) -> None:
    """A commit not signed by a member is PERMISSION_DENIED, a PrivateMessage commit
    INVALID_ARGUMENT, even from a member's account; neither is logged nor moves the epoch. The
    issue's attack (eight well-framed PrivateMessage commits at the current and next epochs)
    leaves the members able to commit and send."""
    relay_a, relay_b = accounts.relay(), accounts.relay()
    relay_a.create(CHANNEL)
    group = relay_a.groups[CHANNEL]
    bob = Member(relay_b, "bob")
    group.add([bob])  # epoch 1
    # A forger holds B's account (its token) but never was a member: its own group of that
    # name, at the channel's epoch, signs with a key no leaf of the channel has.
    forger = Member(relay_b, "forger")
    forger.engine.create_group(CHANNEL)
    forger.engine.self_update(CHANNEL)
    forger.engine.merge_pending_commit(CHANNEL)
    assert forger.engine.epoch(CHANNEL) == 1
    forged = forger.update(CHANNEL)  # sender: leaf 0 (alice's in the channel)
    code, details = refusal(lambda: relay_b.publish(CHANNEL, forged))
    assert code == DENIED, details
    # A member's real commit with its signature broken is not a member's either.
    honest = group.creator.update(CHANNEL)
    broken = bytearray(honest)
    broken[-70] ^= 1  # in the signature (before the confirmation and membership tags)
    code, details = refusal(lambda: relay_a.publish(CHANNEL, bytes(broken)))
    assert code == DENIED, details
    group.creator.settle(CHANNEL, accepted=False)
    # The attack, from a member's account: PrivateMessage commits at the current epoch
    # and the next, alternating.
    for n in range(8):
        epoch = 1 + n % 2
        # Refused for what it is at any epoch (before the fence looks at it).
        assert refusal(relay_b.publish, CHANNEL, _private_commit(CHANNEL, epoch, n)) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "handshake messages (commits and proposals) must be PublicMessages",
        )
    # Nothing was logged and the epoch did not move: a member's commit at epoch 1 is the next
    # entry, the other member applies it, and both still send and read each other.
    assert relay_a.list_members(CHANNEL).epoch == 1
    assert group.commit() == pb.PublishResponse(seq=2, epoch=2)
    assert bob.send(CHANNEL, b"still here").seq == 3
    entries = log_of(relay_a, CHANNEL, 3)
    assert group.creator.apply(CHANNEL, entries[2].message).payload == b"still here"
    assert group.creator.send(CHANNEL, b"me too").seq == 4
    assert bob.apply(CHANNEL, log_of(relay_b, CHANNEL, 4)[3].message).payload == b"me too"
    forger.close()


def _removal_setup(accounts: Accounts) -> tuple[Relay, Relay, Group, Member, Member]:
    """A's channel with two agents of B's account as members (seq 1, epoch 1)."""
    relay_a, relay_b = accounts.relay(), accounts.relay()
    relay_b2 = Relay(relay_b.url, relay_b.token)  # a second agent of B's account
    accounts.relays.append(relay_b2)
    relay_a.create(CHANNEL)
    group = relay_a.groups[CHANNEL]
    bob, bob2 = Member(relay_b, "bob"), Member(relay_b2, "bob2")
    group.add([bob, bob2])
    return relay_a, relay_b, group, bob, bob2


def test_removal_ends_the_removed_accounts_access(accounts: Accounts) -> None:
    """B's live Subscribe gets the entries up to the commit that removed B's last leaf, then
    ends with PERMISSION_DENIED within a second; B's publishes are refused from then on. While
    another leaf of B's is bound, B keeps its access.

    A Subscribe that B starts after its removal is answered as the relay does it: the entries
    up to the removing commit at most (so an offline agent learns of its removal), then
    PERMISSION_DENIED; never an entry after that commit."""
    relay_a, relay_b, group, bob, bob2 = _removal_setup(accounts)
    sub = relay_b.subscribe(CHANNEL)
    assert group.creator.send(CHANNEL, b"one").seq == 2
    # One of B's two leaves removed: B still reads and publishes.
    assert group.remove(bob2).seq == 3
    assert bob.send(CHANNEL, b"still in").seq == 4
    assert [e.seq for e in sub.wait_for(4)] == [1, 2, 3, 4]
    # B's last leaf removed: the stream gets that commit, then ends.
    assert group.creator.send(CHANNEL, b"two").seq == 5
    removed = group.remove(bob)
    removed_at = time.monotonic()
    assert removed.seq == 6
    error = sub.wait_end(timeout=5)
    assert time.monotonic() - removed_at < 1.0
    assert [e.seq for e in sub.entries] == [1, 2, 3, 4, 5, 6]
    assert error is not None and status_of(error)[:2] == (DENIED, not_a_member(CHANNEL))
    # The last entry B got is the commit that removed it (B applied it: its group is gone).
    assert sub.entries[-1].message == group.last_commit and not bob.engine.has_group(CHANNEL)
    # From now on B publishes, lists and binds nothing, and reads nothing new.
    denied = (DENIED, not_a_member(CHANNEL))
    assert refusal(lambda: relay_b.publish(CHANNEL, mls.application(CHANNEL, 2))) == denied
    assert refusal(lambda: relay_b.list_members(CHANNEL)) == denied
    assert group.creator.send(CHANNEL, b"after").seq == 7
    late = relay_b.subscribe(CHANNEL, after_seq=2)
    late_error = late.wait_end()
    assert late_error is not None and status_of(late_error)[:2] == denied
    assert [e.seq for e in late.entries] in ([], [3, 4, 5, 6])
    assert [m.account for m in relay_a.list_members(CHANNEL).members] == [relay_a.account]


def test_removal_ends_a_subscribe_many_follow_at_once(accounts: Accounts) -> None:
    """B's SubscribeMany follow gets the entries up to the commit that removed B's last leaf,
    then `ended` (PERMISSION_DENIED) within a second, with nothing after that commit."""
    _, relay_b, group, bob, bob2 = _removal_setup(accounts)
    many = Many(relay_b)
    many.add(CHANNEL)
    assert many.answer(CHANNEL) == 1
    assert group.creator.send(CHANNEL, b"one").seq == 2
    assert group.remove(bob2).seq == 3  # B keeps a leaf: the follow goes on
    assert bob.send(CHANNEL, b"still in").seq == 4
    assert group.remove(bob).seq == 5
    removed_at = time.monotonic()
    many.wait(lambda: len(many.answers[CHANNEL]) == 2, "the follow did not end", timeout=5)
    assert time.monotonic() - removed_at < 1.0
    assert many.answers[CHANNEL][1] == (DENIED, not_a_member(CHANNEL))
    assert many.seqs(CHANNEL) == [1, 2, 3, 4, 5]
    # An add after the removal is refused, as Subscribe would refuse it, and gets nothing new.
    group.creator.send(CHANNEL, b"after")
    many.add(CHANNEL, after_seq=4)
    answer = many.answer(CHANNEL, 3)
    if answer != (DENIED, not_a_member(CHANNEL)):  # answered live: it must end at once
        many.wait(lambda: len(many.answers[CHANNEL]) == 4, "the new follow did not end")
    assert max(many.seqs(CHANNEL)) == 5
    many.cancel()


def test_the_anonymous_principal_follows_the_same_rules(start_server: Start) -> None:
    """With --allow-anonymous, anonymous callers are one account, "": its channels and org are
    its own, others need a bound leaf to reach them, and it needs one to reach theirs."""
    server = start_server("--allow-anonymous", *NO_LIMITS)
    api = Api(server.http_url)
    with (
        Relay(server.relay_url) as anon,
        Relay(server.relay_url, api.token(api.signup().key)) as alice,
    ):
        assert (anon.account, account_of(alice.token)) == ("", alice.account)
        anon.create("anon/x/chat")
        alice.create(CHANNEL)
        # Neither reaches the other's channel, nor creates under the other's org.
        for relay, channel in ((alice, "anon/x/chat"), (anon, CHANNEL)):
            denied = (DENIED, not_a_member(channel))
            assert refusal(relay.publish, channel, mls.application(channel, 0)) == denied
            assert refusal(relay.list_members, channel) == denied
            org = channel.split("/")[0]
            code, details = create_refusal(relay, f"{org}/y/z")
            assert code == DENIED and f"org '{org}' belongs to another account" in details
        # Another anonymous connection is the same account: a member already.
        with Relay(server.relay_url) as other_anon:
            assert other_anon.publish("anon/x/chat", mls.application("anon/x/chat", 0)).seq == 1
        # Alice joins the anonymous channel and binds: she reads, and the roster names both.
        group: Group = anon.groups["anon/x/chat"]
        joiner = Member(alice, "alice")
        group.add([joiner])
        assert log_of(alice, "anon/x/chat", 2)[0].account == ""
        listed = alice.list_members("anon/x/chat").members
        assert [m.account for m in listed] == ["", alice.account]
        # Alice removes the anonymous creator's leaf: the anonymous account is out.
        assert group.remove(group.creator, by=joiner).epoch == 2
        denied = (DENIED, not_a_member("anon/x/chat"))
        assert refusal(lambda: anon.publish("anon/x/chat", mls.application("anon/x/chat", 2))) == (
            denied
        )
        assert joiner.send("anon/x/chat", b"mine now").seq == 4
    api.close()
