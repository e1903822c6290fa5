"""The spec's typical flow and the channel's core behaviour, against a real server."""

from __future__ import annotations

import gc
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest

import static_sdk
from static_sdk import MAX_PAYLOAD, MLSEngineError, StaticClient, TransportError
from tests.sdk.conftest import WAIT, Clients, channel_name, next_within, read_to_end, receive_n
from tests.support.server import ServerProcess


def test_public_api_names() -> None:
    for name in ("StaticClient", "Channel", "MessageIterator", "AsyncMessageIterator"):
        assert name in static_sdk.__all__
        assert getattr(static_sdk, name).__doc__
    for error in ("MLSEngineError", "TransportError", "InvalidChannelNameError", "AuthError"):
        assert issubclass(getattr(static_sdk, error), RuntimeError)


def test_typical_flow(relay: ServerProcess, clients: Clients) -> None:
    alice = clients(relay, b"alice")
    bob = clients(relay, b"bob")
    name = channel_name()
    channel = alice.create_channel(name)
    key_package = bob.generate_key_package()
    assert isinstance(key_package, bytes)
    welcome = channel.add_member(key_package)
    assert isinstance(welcome, bytes)
    bobs = bob.join_channel(name, welcome)
    channel.send(b"hello bob")
    bobs.send(b"hello alice")
    # The spec's blocking iterator (each next() bounded: it has no timeout of its own).
    assert next_within(iter(bobs.messages())) == b"hello bob"
    messages = channel.messages()
    assert iter(messages) is messages
    assert next_within(messages) == b"hello alice"
    assert sorted(channel.members()) == sorted(bobs.members()) == [b"alice", b"bob"]
    assert channel.epoch() == bobs.epoch() == 1
    assert channel.epoch_authenticator() == bobs.epoch_authenticator()


def test_member_never_receives_its_own_messages(relay: ServerProcess, clients: Clients) -> None:
    alices, bobs = clients.pair(relay)
    for i in range(5):
        alices.send(b"a%d" % i)
    bobs.send(b"from bob")
    assert receive_n(bobs, 5) == [b"a%d" % i for i in range(5)]
    assert alices.receive(WAIT) == b"from bob"
    with pytest.raises(TimeoutError):
        alices.receive(0.5)


def test_three_members(relay: ServerProcess, clients: Clients) -> None:
    a, b, c = (clients(relay, who) for who in (b"a", b"b", b"c"))
    name = channel_name()
    ca = a.create_channel(name)
    cb = b.join_channel(name, ca.add_member(b.generate_key_package()))
    # The second add is made by b: any member can add.
    cc = c.join_channel(name, cb.add_member(c.generate_key_package()))
    ca.send(b"from a")
    cb.send(b"from b")
    cc.send(b"from c")
    assert sorted(receive_n(ca, 2)) == [b"from b", b"from c"]
    assert sorted(receive_n(cb, 2)) == [b"from a", b"from c"]
    assert sorted(receive_n(cc, 2)) == [b"from a", b"from b"]
    # b's commit was merged by a in the background, without a iterating in between.
    assert ca.epoch() == cb.epoch() == cc.epoch() == 2
    assert ca.epoch_authenticator() == cb.epoch_authenticator() == cc.epoch_authenticator()
    assert sorted(ca.members()) == [b"a", b"b", b"c"]


def test_large_payloads_up_to_the_limit(relay: ServerProcess, clients: Clients) -> None:
    alices, bobs = clients.pair(relay)
    for size in (0, 1, 64 * 1024, MAX_PAYLOAD):
        payload = bytes([size % 251]) * size
        alices.send(payload)
        assert bobs.receive(WAIT) == payload
    with pytest.raises(TransportError, match=r"^transport error: .*exceeds the maximum"):
        alices.send(b"x" * (MAX_PAYLOAD + 1))
    alices.send(b"still fine")
    assert bobs.receive(WAIT) == b"still fine"


def test_concurrent_senders_while_another_thread_iterates(
    relay: ServerProcess, clients: Clients
) -> None:
    alices, bobs = clients.pair(relay)
    senders, per_sender = 4, 60
    received: list[bytes] = []
    done = threading.Event()

    def iterate() -> None:
        for message in bobs.messages():
            received.append(message)
            if len(received) == senders * per_sender:
                break
        done.set()

    def send(sender: int) -> None:
        for i in range(per_sender):
            alices.send(f"{sender}:{i}".encode())

    reader = threading.Thread(target=iterate, daemon=True)
    reader.start()
    threads = [threading.Thread(target=send, args=(s,)) for s in range(senders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT * 3)
    assert done.wait(WAIT * 3), f"received {len(received)} of {senders * per_sender}"
    assert len(set(received)) == len(received) == senders * per_sender
    by_sender: dict[int, list[int]] = defaultdict(list)
    for message in received:
        sender, i = message.decode().split(":")
        by_sender[int(sender)].append(int(i))
    for order in by_sender.values():
        assert order == list(range(per_sender))


def test_send_and_add_member_concurrently_with_iteration(
    relay: ServerProcess, clients: Clients
) -> None:
    alices, bobs = clients.pair(relay)
    carol = clients(relay, b"carol")
    results: dict[str, bytes] = {}

    def add() -> None:
        results["welcome"] = alices.add_member(carol.generate_key_package())

    adder = threading.Thread(target=add)
    adder.start()
    for i in range(20):
        alices.send(b"m%d" % i)
    adder.join(WAIT)
    assert sorted(receive_n(bobs, 20)) == sorted(b"m%d" % i for i in range(20))
    carols = carol.join_channel(alices.name, results["welcome"])
    alices.send(b"after carol")
    # Carol also gets the messages Alice sent at the new epoch (after her commit merged).
    seen = [carols.receive(WAIT)]
    while seen[-1] != b"after carol":
        seen.append(carols.receive(WAIT))
    assert all(m.startswith(b"m") for m in seen[:-1])


def test_concurrent_add_member_from_two_members_does_not_fork(
    relay: ServerProcess, clients: Clients
) -> None:
    alices, bobs = clients.pair(relay)
    carol, dave = clients(relay, b"carol"), clients(relay, b"dave")
    welcomes: dict[bytes, bytes] = {}
    errors: list[Exception] = []
    barrier = threading.Barrier(2)

    def add(channel: static_sdk.Channel, who: StaticClient) -> None:
        try:
            kp = who.generate_key_package()
            barrier.wait(WAIT)
            welcomes[who.identity] = channel.add_member(kp)
        except Exception as err:  # noqa: BLE001 - reported by the test thread
            errors.append(err)

    threads = [
        threading.Thread(target=add, args=(alices, carol)),
        threading.Thread(target=add, args=(bobs, dave)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT * 2)
    assert not errors, errors
    carols = carol.join_channel(alices.name, welcomes[b"carol"])
    daves = dave.join_channel(alices.name, welcomes[b"dave"])
    # Everyone converges on epoch 3 with the same authenticator.
    alices.send(b"sync")
    for channel in (bobs, carols, daves):
        assert channel.receive(WAIT) == b"sync"
    bobs.send(b"sync2")
    assert alices.receive(WAIT) == b"sync2"
    epochs = {c.epoch() for c in (alices, bobs, carols, daves)}
    assert epochs == {3}
    authenticators = {c.epoch_authenticator() for c in (alices, bobs, carols, daves)}
    assert len(authenticators) == 1
    assert sorted(daves.members()) == [b"alice", b"bob", b"carol", b"dave"]


def test_remove_member_rotate_keys_and_leave(relay: ServerProcess, clients: Clients) -> None:
    alices, bobs = clients.pair(relay)
    carol = clients(relay, b"carol")
    carols = carol.join_channel(alices.name, alices.add_member(carol.generate_key_package()))
    bobs.rotate_keys()
    alices.send(b"after rotation")
    assert bobs.receive(WAIT) == b"after rotation"
    assert carols.receive(WAIT) == b"after rotation"
    alices.remove_member(b"carol")
    assert sorted(alices.members()) == [b"alice", b"bob"]
    # Carol's channel ends: her iterator stops once she has read what she received.
    assert read_to_end(carols.messages()) == []
    alices.send(b"carol cannot read this")
    assert bobs.receive(WAIT) == b"carol cannot read this"
    # Bob leaves: Alice's client commits his proposal by itself.
    bobs.leave()
    assert bobs.closed
    deadline = time.monotonic() + WAIT
    while alices.members() != [b"alice"]:
        assert time.monotonic() < deadline, alices.members()
        time.sleep(0.02)
    alices.send(b"alone")


def test_closing_and_reopening_in_the_same_process(relay: ServerProcess, clients: Clients) -> None:
    alices, bobs = clients.pair(relay)
    bob = clients.opened[1]
    alices.send(b"one")
    assert bobs.receive(WAIT) == b"one"
    bobs.close()
    assert read_to_end(bobs.messages()) == []
    alices.send(b"two")
    alices.send(b"three")
    assert bob.channels() == [alices.name]
    reopened = bob.open_channel(alices.name)
    assert receive_n(reopened, 2) == [b"two", b"three"]
    bob.close()
    again = clients(relay, b"bob", data_dir=clients.tmp_path / "agent-bob")
    assert again.channels() == [alices.name]
    alices.send(b"four")
    assert again.open_channel(alices.name).receive(WAIT) == b"four"


def test_reading_part_of_a_long_inbox_then_reopening(
    relay: ServerProcess, clients: Clients
) -> None:
    """Handed-out messages are marked one by one and deleted in bulk (every 256): reopening at
    any point hands out exactly the rest, in order, whatever was deleted yet."""
    alices, bobs = clients.pair(relay)
    bob = clients.opened[1]
    for i in range(600):
        alices.send(b"m%d" % i)
    deadline = time.monotonic() + WAIT
    while bobs.pending() < 600:
        assert time.monotonic() < deadline, bobs.pending()
        time.sleep(0.02)
    assert receive_n(bobs, 300) == [b"m%d" % i for i in range(300)]
    assert bobs.pending() == 300
    bob.close()
    again = clients(relay, b"bob", data_dir=clients.tmp_path / "agent-bob")
    reopened = again.open_channel(alices.name)
    assert reopened.pending() == 300
    assert receive_n(reopened, 300) == [b"m%d" % i for i in range(300, 600)]
    assert reopened.pending() == 0
    alices.send(b"last")
    assert reopened.receive(WAIT) == b"last"


def test_context_managers(relay: ServerProcess, clients: Clients) -> None:
    with StaticClient(relay.relay_url, clients.tmp_path / "cm", b"cm") as client:
        with client.create_channel(channel_name()) as channel:
            assert channel.members() == [b"cm"]
        assert channel.closed
    # The data directory is released: it opens again.
    with StaticClient(relay.relay_url, clients.tmp_path / "cm", b"cm") as client:
        assert client.channels() == [channel.name]


def test_send_waits_while_a_leave_proposal_is_pending(
    relay: ServerProcess, clients: Clients
) -> None:
    alices, bobs = clients.pair(relay)
    alice = clients.opened[0]
    # With Alice's channel closed nobody commits Bob's leave proposal for now; MLS forbids
    # application messages while it is pending, so Bob's send must wait rather than fail.
    alices.close()
    errors: dict[str, BaseException | None] = {}

    def run(name: str, call: Callable[[], None]) -> threading.Thread:
        def target() -> None:
            try:
                call()
                errors[name] = None
            except BaseException as exc:  # noqa: BLE001  (reported to the test thread)
                errors[name] = exc

        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        return thread

    leaving = run("leave", bobs.leave)
    time.sleep(0.5)
    sending = run("send", lambda: bobs.send(b"while leaving"))
    time.sleep(0.5)
    assert sending.is_alive(), errors.get("send")
    # Alice comes back: her client commits the proposal, Bob is out, his send ends with that.
    alice.open_channel(alices.name)
    leaving.join(WAIT)
    sending.join(WAIT)
    assert errors["leave"] is None
    assert isinstance(errors["send"], MLSEngineError), errors["send"]
    assert str(errors["send"]).startswith("MLS engine error: no longer a member")


def test_the_clients_wal_is_cut_back_after_a_run_of_sends(
    start_server: Callable[..., ServerProcess], clients: Clients, tmp_path: Path
) -> None:
    # Without pauses, background checkpoints never let the WAL restart: it grew by every send
    # (6.4 MB after 200) and was only truncated at the next epoch change.
    relay = start_server("--allow-anonymous", "--relay-publish-rate", "0")
    alices, bobs = clients.pair(relay)
    sends = 200
    for i in range(sends):
        alices.send(b"%d" % i + bytes(1024))
    assert len(receive_n(bobs, sends)) == sends
    wal = tmp_path / "agent-alice" / "mls.sqlite3-wal"
    deadline = time.monotonic() + WAIT
    while wal.exists() and wal.stat().st_size > 1024 * 1024:
        assert time.monotonic() < deadline, f"the WAL is still {wal.stat().st_size} bytes"
        time.sleep(0.05)
    alices.send(b"and on")
    assert bobs.receive(WAIT) == b"and on"


def test_connections_the_relay_closed_for_idleness_are_reopened(
    start_server: Callable[..., ServerProcess], clients: Clients
) -> None:
    # The relay closes a connection without a call (--relay-idle-timeout): the SDK's next
    # call reconnects, whatever it was doing between.
    server = start_server("--allow-anonymous", "--relay-idle-timeout", "0.3")
    alice, bob = clients(server, b"alice"), clients(server, b"bob")
    name = channel_name()
    alices = alice.create_channel(name)
    key_package = bob.generate_key_package()
    time.sleep(1)
    bobs = bob.join_channel(name, alices.add_member(key_package))
    time.sleep(1)
    alices.send(b"after a pause")
    assert bobs.receive(WAIT) == b"after a pause"
    time.sleep(1)
    bobs.send(b"and another")
    assert alices.receive(WAIT) == b"and another"
    assert "server error" not in server.stderr()


def test_a_channel_keeps_its_client_open(relay: ServerProcess, clients: Clients) -> None:
    """``StaticClient(...).create_channel(name)`` without keeping the client: the channel, and
    an iterator of it nobody else keeps, still work after a garbage collection; the client
    closes once nothing uses it, releasing its data directory."""
    data_dir = clients.tmp_path / "kept-by-its-channel"
    channel = StaticClient(relay.relay_url, data_dir, b"alice").create_channel(channel_name())
    bob = clients(relay, b"bob")
    gc.collect()
    welcome = channel.add_member(bob.generate_key_package())
    bobs = bob.join_channel(channel.name, welcome)
    channel.send(b"hello")
    assert bobs.receive(WAIT) == b"hello"
    messages = channel.messages()
    del channel
    gc.collect()
    bobs.send(b"back")
    assert next_within(messages) == b"back"
    # The last reference gone, the directory is free again.
    del messages
    gc.collect()
    reopened = clients(relay, b"alice", data_dir=data_dir)
    assert reopened.channels() == [bobs.name]
