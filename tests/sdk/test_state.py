"""The SDK's state on disk: damage to ``inbox.marks`` or ``mls.sqlite3`` between two runs is
refused with ``runtime error:`` naming the file (never a message handed out twice, never a new
identity in place of the old one), and the data directory is private."""

from __future__ import annotations

import os
import stat
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

from static_sdk import Channel, InternalError, StaticClient
from tests.sdk.conftest import WAIT, Clients, channel_name, receive_n
from tests.support.server import ServerProcess


def _bob_read_three_of_five(relay: ServerProcess, clients: Clients, tmp_path: Path) -> Channel:
    """Alice sends m0..m4; Bob (data in ``tmp_path / "bob"``) reads m0..m2 and closes."""
    alice = clients(relay, b"alice")
    bob = StaticClient(relay.relay_url, tmp_path / "bob", b"bob")
    name = channel_name()
    alices = alice.create_channel(name)
    bobs = bob.join_channel(name, alices.add_member(bob.generate_key_package()))
    for i in range(5):
        alices.send(b"m%d" % i)
    assert receive_n(bobs, 3) == [b"m0", b"m1", b"m2"]
    # All five applied (stored in the inbox) before Bob stops.
    deadline = time.monotonic() + WAIT
    while bobs.pending() < 2:
        assert time.monotonic() < deadline, "m3 and m4 never arrived"
        time.sleep(0.02)
    bob.close()
    return alices


def _reopen_and_read(relay: ServerProcess, data_dir: Path, name: str) -> list[bytes]:
    """Bob reopened: what he reads (until nothing more comes)."""
    with StaticClient(relay.relay_url, data_dir, b"bob") as bob:
        channel = bob.open_channel(name)
        got = []
        while True:
            try:
                got.append(channel.receive(0.5))
            except TimeoutError:
                return got


def _refused(relay: ServerProcess, data_dir: Path, name: str, file: str) -> str:
    """Reopening Bob fails (at the client, the channel, or its first read) with
    ``InternalError`` naming ``file``; its message."""
    with pytest.raises(InternalError) as info:
        _reopen_and_read(relay, data_dir, name)
    message = str(info.value)
    assert message.startswith("runtime error: ")
    assert str(data_dir / file) in message and "damaged" in message, message
    return message


Damage = Callable[[Path], None]


def _delete(path: Path) -> None:
    path.unlink()


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _cut_last_byte(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-1])


def _flip_a_mark(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[32] ^= 0x01  # the first channel's mark (after the 32-byte header)
    path.write_bytes(bytes(data))


def _zero_the_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[:8] = bytes(8)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage", [_delete, _empty, _cut_last_byte, _flip_a_mark, _zero_the_header]
)
def test_damaged_inbox_marks_never_hands_out_a_message_again(
    relay: ServerProcess, clients: Clients, tmp_path: Path, damage: Damage
) -> None:
    alices = _bob_read_three_of_five(relay, clients, tmp_path)
    marks = tmp_path / "bob" / "inbox.marks"
    good = marks.read_bytes()
    damage(marks)
    message = _refused(relay, tmp_path / "bob", alices.name, "inbox.marks")
    assert "backup" in message
    # Refused again (nothing was made up in its place), until the file is restored: then Bob
    # reads exactly what he had not read.
    _refused(relay, tmp_path / "bob", alices.name, "inbox.marks")
    marks.write_bytes(good)
    assert _reopen_and_read(relay, tmp_path / "bob", alices.name) == [b"m3", b"m4"]


def _cut_in_half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _garbage(path: Path) -> None:
    path.write_bytes(os.urandom(path.stat().st_size))


@pytest.mark.parametrize("damage", [_delete, _empty, _cut_in_half, _garbage])
def test_a_damaged_database_is_refused_not_a_new_identity(
    relay: ServerProcess, clients: Clients, tmp_path: Path, damage: Damage
) -> None:
    alices = _bob_read_three_of_five(relay, clients, tmp_path)
    database = tmp_path / "bob" / "mls.sqlite3"
    # Closed cleanly: everything is in the database file, the write-ahead log is empty.
    assert not (tmp_path / "bob" / "mls.sqlite3-wal").exists() or (
        (tmp_path / "bob" / "mls.sqlite3-wal").stat().st_size == 0
    )
    good = database.read_bytes()
    damage(database)
    for _ in range(2):
        with pytest.raises(InternalError) as info:
            StaticClient(relay.relay_url, tmp_path / "bob", b"bob")
        message = str(info.value)
        assert message.startswith("runtime error: ")
        assert f"{database} is damaged" in message, message
    database.write_bytes(good)
    assert _reopen_and_read(relay, tmp_path / "bob", alices.name) == [b"m3", b"m4"]


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_data_directory_is_private(relay: ServerProcess, tmp_path: Path) -> None:
    data_dir = tmp_path / "new" / "alice"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a directory the SDK makes gets no warning
        client = StaticClient(relay.relay_url, data_dir, b"alice")
    with client:
        channel = client.create_channel(channel_name())
        channel.send(b"hello")
        assert _mode(data_dir) == 0o700
        files = {p.name: _mode(p) for p in data_dir.iterdir()}
        for name in ["mls.sqlite3", "mls.sqlite3-wal", "mls.sqlite3-shm", "inbox.marks", "lock"]:
            assert name in files, files
        assert set(files.values()) == {0o600}, files


@pytest.mark.parametrize("mode", [0o755, 0o750, 0o701])
def test_a_data_directory_others_may_enter_gets_a_warning(
    relay: ServerProcess, tmp_path: Path, mode: int
) -> None:
    data_dir = tmp_path / "shared"
    data_dir.mkdir()
    data_dir.chmod(mode)
    with pytest.warns(UserWarning, match=r"open to other users .*chmod 700") as caught:
        client = StaticClient(relay.relay_url, data_dir, b"alice")
    client.close()
    assert caught[0].filename == __file__  # points at the caller's line
    # Files are private all the same.
    assert {_mode(p) for p in data_dir.iterdir()} == {0o600}
    data_dir.chmod(0o700)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        StaticClient(relay.relay_url, data_dir, b"alice").close()


def test_reading_is_unchanged_across_clean_reopenings(
    relay: ServerProcess, clients: Clients, tmp_path: Path
) -> None:
    """The checks refuse nothing healthy: reopened twice, Bob reads what he had not read, and
    a channel made after the first reopening gets its own mark."""
    alices = _bob_read_three_of_five(relay, clients, tmp_path)
    assert _reopen_and_read(relay, tmp_path / "bob", alices.name) == [b"m3", b"m4"]
    alices.send(b"m5")
    with StaticClient(relay.relay_url, tmp_path / "bob", b"bob") as bob:
        assert bob.open_channel(alices.name).receive(WAIT) == b"m5"
    assert _reopen_and_read(relay, tmp_path / "bob", alices.name) == []
