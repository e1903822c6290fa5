"""Every row of the client error table (docs/sdk.md, Errors), with its prefix, against a server."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from static_sdk import (
    AuthError,
    InternalError,
    InvalidChannelNameError,
    MLSEngineError,
    StaticClient,
    TransportError,
)
from tests.sdk.conftest import WAIT, Clients, channel_name
from tests.support.server import ServerProcess, free_port

FORM = "org/namespace/service"


@pytest.mark.parametrize("bad", ["", "acme", "acme/agents", "a/b/c/d", "a//c", "/a/b", "a b/c/d"])
def test_invalid_channel_name(relay: ServerProcess, clients: Clients, bad: str) -> None:
    client = clients(relay, b"alice")
    calls: list[Callable[[], object]] = [
        lambda: client.create_channel(bad),
        lambda: client.join_channel(bad, b"welcome"),
        lambda: client.open_channel(bad),
    ]
    for call in calls:
        with pytest.raises(InvalidChannelNameError) as info:
            call()
        message = str(info.value)
        assert message.startswith("invalid channel name:")
        assert repr(bad) in message and FORM in message
        assert isinstance(info.value, RuntimeError)


def test_mls_engine_errors(relay: ServerProcess, clients: Clients) -> None:
    alice, bob = clients(relay, b"alice"), clients(relay, b"bob")
    channel = alice.create_channel(channel_name())
    calls: list[Callable[[], object]] = [
        lambda: channel.add_member(b"not a key package"),
        lambda: bob.join_channel(channel.name, b"not a welcome"),
        lambda: alice.create_channel(channel.name),
        lambda: bob.open_channel(channel.name),
    ]
    for call in calls:
        with pytest.raises(MLSEngineError, match=r"^MLS engine error: "):
            call()
    # A Welcome for another channel is refused too.
    welcome = channel.add_member(bob.generate_key_package())
    with pytest.raises(MLSEngineError, match=r"^MLS engine error: "):
        bob.join_channel(channel_name(), welcome)
    # The channel stays usable after every refusal.
    bobs = bob.join_channel(channel.name, welcome)
    channel.send(b"ok")
    assert bobs.receive(WAIT) == b"ok"


def test_adding_a_member_twice_says_so(relay: ServerProcess, clients: Clients) -> None:
    alice, bob = clients(relay, b"alice"), clients(relay, b"bob")
    channel = alice.create_channel(channel_name())
    channel.add_member(bob.generate_key_package())
    epoch = channel.epoch()
    # A fresh key package of a member already in the group: refused before any commit.
    with pytest.raises(MLSEngineError) as info:
        channel.add_member(bob.generate_key_package())
    message = str(info.value)
    assert message.startswith("MLS engine error: cannot add b'bob'")
    assert "is already in channel" in message and channel.name in message
    assert "DuplicateSignatureKey" not in message
    assert channel.epoch() == epoch
    # Nothing was left pending: the channel goes on.
    channel.rotate_keys()


def test_someone_elses_welcome_says_so(relay: ServerProcess, clients: Clients) -> None:
    alice, bob, carol = clients(relay, b"alice"), clients(relay, b"bob"), clients(relay, b"carol")
    channel = alice.create_channel(channel_name())
    welcome = channel.add_member(bob.generate_key_package())
    with pytest.raises(MLSEngineError) as info:
        carol.join_channel(channel.name, welcome)
    message = str(info.value)
    assert message.startswith("MLS engine error: this Welcome is not addressed to this client")
    assert "NoMatchingKeyPackage" not in message
    assert carol.channels() == []
    # Bob's own Welcome still works.
    bob.join_channel(channel.name, welcome)


def test_channel_existing_on_the_relay(relay: ServerProcess, clients: Clients) -> None:
    name = channel_name()
    clients(relay, b"alice").create_channel(name)
    with pytest.raises(MLSEngineError, match=r"^MLS engine error: .*already exists on the relay"):
        clients(relay, b"mallory").create_channel(name)


def test_transport_errors(tmp_path: Path) -> None:
    # Nothing listens: the first contact fails within the connect timeout (1 s by default),
    # not after the 30 s a relay that answered before is retried for.
    with StaticClient(f"grpc://127.0.0.1:{free_port()}", tmp_path / "a", b"alice") as client:
        for attempt in (client.create_channel, lambda name: client.join_channel(name, b"w")):
            started = time.monotonic()
            with pytest.raises(TransportError, match=r"^transport error: cannot reach the relay"):
                attempt(channel_name())
            assert time.monotonic() - started < 2.0
    with pytest.raises(TransportError, match=r"^transport error: .*endpoint"):
        StaticClient("ftp://127.0.0.1:1", tmp_path / "b", b"bob")


def test_connect_timeout_is_configurable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"grpc://127.0.0.1:{free_port()}"
    for i, (timeout, env) in enumerate([(2.5, None), (None, "2.5")]):
        if env is not None:
            monkeypatch.setenv("STATIC_SDK_CONNECT_TIMEOUT", env)
        with StaticClient(url, tmp_path / str(i), b"alice", connect_timeout=timeout) as client:
            started = time.monotonic()
            with pytest.raises(TransportError, match=r"gave up after 2.5s"):
                client.create_channel(channel_name())
            assert 2.0 < time.monotonic() - started < 5.0
    with pytest.raises(ValueError, match="connect_timeout"):
        StaticClient(url, tmp_path / "bad", b"a", connect_timeout=-1)
    with pytest.raises(TypeError, match="retry_timeout"):
        StaticClient(url, tmp_path / "bad", b"a", retry_timeout="30")  # type: ignore[arg-type]


def test_a_join_that_cannot_reach_the_relay_keeps_the_welcome_usable(
    relay: ServerProcess, tmp_path: Path
) -> None:
    with StaticClient(relay.relay_url, tmp_path / "alice", b"alice") as alice:
        name = channel_name()
        alices = alice.create_channel(name)
        with StaticClient(f"grpc://127.0.0.1:{free_port()}", tmp_path / "bob", b"bob") as bob:
            welcome = alices.add_member(bob.generate_key_package())
            with pytest.raises(TransportError, match=r"cannot reach the relay"):
                bob.join_channel(name, welcome)
            assert bob.channels() == []
        with StaticClient(relay.relay_url, tmp_path / "bob", b"bob") as bob:
            bobs = bob.join_channel(name, welcome)
            alices.send(b"hello")
            assert bobs.receive(WAIT) == b"hello"


def test_endpoint_forms(relay: ServerProcess, tmp_path: Path) -> None:
    host_port = relay.relay_url.removeprefix("grpc://")
    for i, endpoint in enumerate([relay.relay_url, f"http://{host_port}", host_port]):
        with StaticClient(endpoint, tmp_path / str(i), b"agent") as client:
            assert client.create_channel(channel_name()).members() == [b"agent"]


def test_https_endpoint_speaks_tls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A plaintext relay cannot complete a TLS handshake: the failure is a transport error.
    monkeypatch.setenv("STATIC_SDK_RETRY_TIMEOUT", "1")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with StaticClient(f"https://localhost:{port}", tmp_path / "tls", b"a") as client:  # noqa: SIM117
            with pytest.raises(TransportError, match=r"^transport error: "):
                client.create_channel(channel_name())


def test_auth_errors_without_a_server(tmp_path: Path) -> None:
    with pytest.raises(AuthError, match=r"^auth error: .*api_url"):
        StaticClient("grpc://127.0.0.1:1", tmp_path / "a", b"a", api_key="sk_live_x")
    with pytest.raises(TransportError, match=r"^transport error: cannot reach the API"):
        StaticClient(
            "grpc://127.0.0.1:1",
            tmp_path / "b",
            b"b",
            api_key="sk_live_x",
            api_url=f"http://127.0.0.1:{free_port()}",
        )


def test_runtime_errors(relay: ServerProcess, clients: Clients, tmp_path: Path) -> None:
    clients(relay, b"alice", data_dir=tmp_path / "shared")
    with pytest.raises(InternalError, match=r"^runtime error: .*in use"):
        StaticClient(relay.relay_url, tmp_path / "shared", b"alice")
    clients.close()
    with pytest.raises(InternalError, match=r"^runtime error: .*belongs to identity"):
        StaticClient(relay.relay_url, tmp_path / "shared", b"bob")
    client = StaticClient(relay.relay_url, tmp_path / "closed", b"c")
    client.close()
    with pytest.raises(InternalError, match=r"^runtime error: .*closed"):
        client.create_channel(channel_name())


def test_type_errors(tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        StaticClient("grpc://127.0.0.1:1", tmp_path, "alice")  # type: ignore[arg-type]


def test_ctrl_c_interrupts_a_blocked_iterator_within_100_ms(
    relay: ServerProcess, clients: Clients
) -> None:
    alices, _ = clients.pair(relay)
    sent_at: list[float] = []

    def interrupt() -> None:
        time.sleep(0.3)
        sent_at.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        next(alices.messages())
    latency = time.monotonic() - sent_at[0]
    assert latency < 0.1, latency
    # The channel is still usable.
    alices.send(b"after ctrl-c")
