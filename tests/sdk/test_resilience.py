"""Relay restarts and killed clients: nothing lost, nothing repeated. Both store backends."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import BACKENDS
from tests.sdk.conftest import WAIT, Clients, channel_name, receive_n
from tests.support import sqlite_apart
from tests.support.process import LineProcess
from tests.support.server import ServerProcess, restartable_args


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    value: str = request.param
    return value


def test_typical_flow_on_both_backends(relay: ServerProcess, clients: Clients) -> None:
    alices, bobs = clients.pair(relay)
    alices.send(b"hello")
    bobs.send(b"hi")
    assert bobs.receive(WAIT) == b"hello"
    assert alices.receive(WAIT) == b"hi"


def test_relay_restart_mid_stream_loses_nothing(
    start_server: Callable[..., ServerProcess], clients: Clients
) -> None:
    # Fixed ports, so the restarted relay is where the clients look for it.
    server = start_server(*restartable_args("--allow-anonymous"))
    alices, bobs = clients.pair(server)
    total = 60
    received: list[bytes] = []
    done = threading.Event()

    def iterate() -> None:
        for message in bobs.messages():
            received.append(message)
            if len(received) == total:
                break
        done.set()

    threading.Thread(target=iterate, daemon=True).start()
    for i in range(total // 2):
        alices.send(b"%d" % i)
    server.restart()
    # Sends during and after the restart block briefly (reconnect with backoff), never fail.
    for i in range(total // 2, total):
        alices.send(b"%d" % i)
    assert done.wait(WAIT * 2), f"received {len(received)} of {total}"
    assert received == [b"%d" % i for i in range(total)]
    # Commits still work after the restart, and so does the other direction.
    bobs.rotate_keys()
    bobs.send(b"back")
    assert alices.receive(WAIT) == b"back"


class Agent(LineProcess):
    """tests/sdk/agent.py in a subprocess, its stdout read line by line."""

    def __init__(self, relay: str, data_dir: Path, name: str, work: Path, stop_after: int):
        super().__init__(
            "tests.sdk.agent", relay, str(data_dir), "bob", name, str(work), str(stop_after)
        )

    def kill(self) -> None:
        self.end(kill=True, timeout=WAIT)


def test_client_process_killed_and_restarted(
    relay: ServerProcess, clients: Clients, tmp_path: Path
) -> None:
    alice = clients(relay, b"alice")
    name = channel_name()
    channel = alice.create_channel(name)
    data_dir = tmp_path / "bob-data"
    agent = Agent(relay.relay_url, data_dir, name, tmp_path, stop_after=10)
    try:
        deadline = time.monotonic() + WAIT
        while not (tmp_path / "kp").exists():
            assert time.monotonic() < deadline, "no key package"
            time.sleep(0.02)
        welcome = channel.add_member((tmp_path / "kp").read_bytes())
        (tmp_path / "welcome.tmp").write_bytes(welcome)
        (tmp_path / "welcome.tmp").rename(tmp_path / "welcome")
        assert agent.line(WAIT) == "ready"
        for i in range(10):
            channel.send(b"m%d" % i)
        assert [agent.line(WAIT) for _ in range(10)] == [f"m{i}" for i in range(10)]
        assert agent.line(WAIT) == "idle"
        # The agent no longer reads, but its client applies the log in the background; it is
        # killed while doing so (a commit among the messages).
        for i in range(10, 20):
            channel.send(b"m%d" % i)
        channel.rotate_keys()
        for i in range(20, 25):
            channel.send(b"m%d" % i)
    finally:
        agent.kill()
    # Sent while the agent is down.
    for i in range(25, 30):
        channel.send(b"m%d" % i)
    restarted = Agent(relay.relay_url, data_dir, name, tmp_path, stop_after=20)
    try:
        assert restarted.line(WAIT) == "ready"
        got = [restarted.line(WAIT) for _ in range(20)]
        assert got == [f"m{i}" for i in range(10, 30)]
        assert restarted.line(WAIT) == "idle"
    finally:
        restarted.kill()
    # And the restarted agent's group state is consistent with Alice's.
    with_bob = clients(relay, b"bob", data_dir=data_dir)
    bobs = with_bob.open_channel(name)
    assert bobs.epoch() == channel.epoch()
    assert bobs.epoch_authenticator() == channel.epoch_authenticator()
    bobs.send(b"bob is back")
    assert receive_n(channel, 1) == [b"bob is back"]


def test_machine_restart_moves_to_a_new_epoch_before_sending(
    relay: ServerProcess, clients: Clients, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sends do not wait for the disk, so a power loss may take back the ratchet advance of a
    message already sent. After the machine restarts, the client first moves the channel to a
    new epoch, so that no key and nonce is used twice: Bob reads every message (one encrypted
    with a reused generation would be unreadable for him)."""
    monkeypatch.setenv("STATIC_TEST_BOOT_ID", "boot-1")
    alices, bobs = clients.pair(relay)
    alices.send(b"one")
    assert receive_n(bobs, 1) == [b"one"]
    data_dir = tmp_path / "agent-alice"
    disk = tmp_path / "what-the-disk-keeps.sqlite3"
    sqlite_apart.execute(data_dir / "mls.sqlite3", "VACUUM INTO ?", str(disk))
    alices.send(b"two")
    assert receive_n(bobs, 1) == [b"two"]
    epoch = alices.epoch()

    # The power goes: the disk holds the copy, whose last opening was not closed.
    clients.opened[0].close()
    for written in data_dir.glob("mls.sqlite3*"):
        written.unlink()
    shutil.copy(disk, data_dir / "mls.sqlite3")
    monkeypatch.setenv("STATIC_TEST_BOOT_ID", "boot-2")
    channel = clients(relay, b"alice").open_channel(alices.name)
    channel.send(b"three")
    assert receive_n(bobs, 1) == [b"three"]
    assert channel.epoch() == bobs.epoch() == epoch + 1
    assert channel.epoch_authenticator() == bobs.epoch_authenticator()
