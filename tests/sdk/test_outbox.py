"""The outbox: what ``send_pipelined`` accepted survives the sender's crash, and the next opening
sends it first, with the same bytes, so that the other members read every message exactly once
and in order without the program resending anything; across commits, a resent message is
delivered or its loss is reported."""

from __future__ import annotations

import random
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from static_sdk import InternalError, TransportError
from tests.sdk.conftest import WAIT, Clients, channel_name, receive_n
from tests.support import sqlite_apart
from tests.support.process import LineProcess
from tests.support.server import ServerProcess, restartable_args

#: Messages of the kill test, and how many times the sender is killed on the way.
TOTAL = 20_000
KILLS = 6


class _Sender(LineProcess):
    """tests/sdk/pipelined_agent.py in a subprocess, its stdout read line by line."""

    def __init__(self, relay: str, data_dir: Path, name: str, total: int) -> None:
        super().__init__(
            "tests.sdk.pipelined_agent", relay, str(data_dir), "alice", name, str(total), stdin=True
        )

    def go_on(self) -> None:
        """Lets it send the next 500 messages."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"\n")
        self.proc.stdin.flush()

    def stop(self, kill: bool) -> None:
        code = self.end(kill=kill, timeout=WAIT)
        assert kill or code == 0, f"the sender exited with {code}"


def test_a_sender_killed_again_and_again_sends_each_message_once(
    relay: ServerProcess, clients: Clients, tmp_path: Path
) -> None:
    name = channel_name()
    alice_dir = tmp_path / "alice-data"
    alice, bob = clients(relay, b"alice", data_dir=alice_dir), clients(relay, b"bob")
    bobs = bob.join_channel(name, alice.create_channel(name).add_member(bob.generate_key_package()))
    # Alice's data_dir goes to the sending processes.
    alice.close()
    received: list[bytes] = []
    all_in = threading.Event()

    def read() -> None:
        for message in bobs.messages():
            received.append(message)
            if len(received) == TOTAL:
                break
        all_in.set()

    threading.Thread(target=read, daemon=True).start()
    seed = random.randrange(1 << 32)
    rng = random.Random(seed)
    starts = []
    for _ in range(KILLS):
        sender = _Sender(relay.relay_url, alice_dir, name, TOTAL)
        try:
            ready = sender.line(WAIT)
            starts.append(int(ready.split()[1]))
            # Killed 1-3 progress points (500 messages apart) on, a random moment after it
            # was let go on: in the middle of queueing, encrypting and publishing.
            for _ in range(rng.randint(1, 3)):
                assert sender.line(WAIT).startswith("at"), f"no progress (seed {seed})"
                sender.go_on()
            time.sleep(rng.uniform(0, 0.02))
        finally:
            sender.stop(kill=True)
    last = _Sender(relay.relay_url, alice_dir, name, TOTAL)
    try:
        starts.append(int(last.line(WAIT).split()[1]))
        while last.line(WAIT) != "done":
            last.go_on()
    finally:
        last.stop(kill=False)
    assert all_in.wait(WAIT), f"received {len(received)} of {TOTAL} (seed {seed}, runs {starts})"
    expected = [b"%06d" % i for i in range(TOTAL)]
    first_wrong = next(
        (i for i, (got, want) in enumerate(zip(received, expected, strict=True)) if got != want),
        None,
    )
    assert first_wrong is None, (
        f"message {first_wrong} is {received[first_wrong]!r} (seed {seed}, runs {starts})"
    )
    # Nothing came twice: nothing more arrives.
    with pytest.raises(TimeoutError):
        bobs.receive(0.5)
    # Each run went on from where the one before it was killed, and got somewhere.
    assert starts == sorted(starts) and len(set(starts)) == len(starts), starts


#: Messages the sender journals before it is killed, in the journal damage test.
JOURNALED = 3000


@pytest.mark.parametrize("damage", ["payload-byte", "length-field"])
def test_a_damaged_journal_is_refused_naming_it(
    start_server: Callable[..., ServerProcess], clients: Clients, tmp_path: Path, damage: str
) -> None:
    """A sender journals 3,000 messages (the relay is down: it encrypts only its first batch)
    and goes; one byte of a message, or one record's length field, is then damaged in its
    journal. The reopened channel refuses it with ``runtime error:`` naming the file. Before,
    the altered message was sent, or the records after the bad length were silently left out
    (768 of 3,000 in the report) while ``pipelined_count()`` said 3,000."""
    server = start_server(*restartable_args("--allow-anonymous"))
    name = channel_name()
    alice_dir = tmp_path / "alice-data"
    alice = clients(server, b"alice", data_dir=alice_dir)
    alices = alice.create_channel(name)
    server.stop()
    for i in range(JOURNALED):
        alices.send_pipelined(b"%06d" % i)
    _encrypted(alice_dir)
    # What a kill leaves too: the journal as written (a close keeps what is queued).
    alice.close()
    segment = alice_dir / "journal" / f"{name.replace('/', '+')}.0"
    bytes_ = bytearray(segment.read_bytes())
    assert b"%06d" % (JOURNALED - 1) in bytes_
    # Message 2000's payload, and its record's header before it (docs/sdk.md, the outbox):
    # len (4 bytes), place (8), two checksums (4 + 4).
    payload_at = bytes_.index(b"%06d" % 2000)
    if damage == "payload-byte":
        bytes_[payload_at + 3] ^= 0x01
    else:
        bytes_[payload_at - 20 : payload_at - 16] = (0xFFFF).to_bytes(4, "little")
    segment.write_bytes(bytes_)
    server.start()
    reopened = clients(server, b"alice", data_dir=alice_dir)
    named = re.escape(f"/journal/{segment.name}")
    with pytest.raises(InternalError, match=rf"^runtime error: \S*{named} is damaged"):
        reopened.open_channel(name)


def _encrypted(data_dir: Path) -> int:
    """How many messages the sender has encrypted into the outbox, once it has some: its first
    batch, which it publishes (against a relay that is down) before it encrypts another."""
    count = sqlite_apart.poll_value(
        data_dir / "mls.sqlite3", "SELECT count(*) FROM static_outbox", WAIT
    )
    assert count > 0, "the sender encrypted nothing"
    return count


@pytest.mark.parametrize(
    ("rotations", "delivered"),
    # The relay accepts application messages of the 5 epochs before the channel's (its
    # --relay-application-window), and members keep those epochs' secrets (PAST_EPOCHS).
    [(3, True), (7, False)],
    ids=["within-the-window", "beyond-the-window"],
)
def test_an_outbox_resent_after_commits_is_delivered_or_reported(
    start_server: Callable[..., ServerProcess],
    clients: Clients,
    tmp_path: Path,
    rotations: int,
    delivered: bool,
) -> None:
    server = start_server(*restartable_args("--allow-anonymous"))
    name = channel_name()
    alice_dir = tmp_path / "alice-data"
    alice, bob = clients(server, b"alice", data_dir=alice_dir), clients(server, b"bob")
    alices = alice.create_channel(name)
    bobs = bob.join_channel(name, alices.add_member(bob.generate_key_package()))
    alices.send(b"before")
    assert receive_n(bobs, 1) == [b"before"]
    # The relay is down: the messages wait in the outbox, and the client goes away.
    server.stop()
    queued = [b"queued %d" % i for i in range(10)]
    for payload in queued:
        alices.send_pipelined(payload)
    # Some are encrypted (at this epoch) into the outbox before the client goes, which a
    # reopening cannot encrypt again; the others are only journaled.
    encrypted = _encrypted(alice_dir)
    alice.close()
    server.start()
    for _ in range(rotations):
        bobs.rotate_keys()
    reopened = clients(server, b"alice", data_dir=alice_dir).open_channel(name)
    assert reopened.pipelined_count() == len(queued)
    if delivered:
        reopened.flush(WAIT)
        assert receive_n(bobs, len(queued)) == queued
    else:
        # Encrypted at an epoch the relay no longer takes, and the outbox keeps no plaintext
        # to encrypt it again: each such message fails, said at the next flush. Those only
        # journaled are encrypted now, at the channel's epoch.
        with pytest.raises(TransportError, match=r"cannot be sent.*no plaintext"):
            reopened.flush(WAIT)
        assert receive_n(bobs, len(queued) - encrypted) == queued[encrypted:]
    # Either way the channel goes on, and nothing of the outbox comes later.
    reopened.send(b"after")
    assert receive_n(bobs, 1) == [b"after"]
    with pytest.raises(TimeoutError):
        bobs.receive(0.3)
