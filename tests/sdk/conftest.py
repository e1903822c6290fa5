"""Fixtures of the SDK tests: real ``static serve`` processes and real clients over them."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from static_sdk import Channel, StaticClient
from tests.support.api import Api
from tests.support.server import ServerProcess

__all__ = ["Clients", "channel_name", "next_within", "read_to_end", "receive_n", "within"]

T = TypeVar("T")

#: Upper bound of any single wait in these tests (nothing may hang).
WAIT = 20.0


@pytest.fixture
def backend() -> str:
    """SQLite only here; modules that need both backends override this fixture."""
    return "sqlite"


@pytest.fixture
def authed(start_server: Callable[..., ServerProcess]) -> ServerProcess:
    """A server that requires tokens."""
    return start_server()


@pytest.fixture
def api(authed: ServerProcess) -> Iterator[Api]:
    """The HTTP API of ``authed``, for accounts and keys."""
    client = Api(authed.http_url)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def relay(start_server: Callable[..., ServerProcess]) -> ServerProcess:
    """A server that accepts anonymous relay access."""
    return start_server("--allow-anonymous")


def channel_name(prefix: str = "acme") -> str:
    return f"{prefix}/t{uuid.uuid4().hex[:10]}/chan"


class Clients:
    """Makes clients on fresh data directories; closes them all at the end of the test."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.opened: list[StaticClient] = []

    def __call__(
        self,
        server: ServerProcess,
        identity: bytes,
        data_dir: Path | None = None,
        api_key: str | None = None,
        api_url: str | None = None,
    ) -> StaticClient:
        directory = data_dir or self.tmp_path / f"agent-{identity.decode()}"
        client = StaticClient(server.relay_url, directory, identity, api_key, api_url)
        self.opened.append(client)
        return client

    def pair(self, server: ServerProcess) -> tuple[Channel, Channel]:
        """Alice creates a channel and adds Bob: the spec's typical flow."""
        alice, bob = self(server, b"alice"), self(server, b"bob")
        name = channel_name()
        alices = alice.create_channel(name)
        welcome = alices.add_member(bob.generate_key_package())
        return alices, bob.join_channel(name, welcome)

    def close(self) -> None:
        for client in self.opened:
            client.close()


@pytest.fixture
def clients(tmp_path: Path) -> Iterator[Clients]:
    made = Clients(tmp_path)
    try:
        yield made
    finally:
        made.close()


def receive_n(channel: Channel, n: int, timeout: float = WAIT) -> list[bytes]:
    """Exactly ``n`` messages, each within ``timeout``."""
    return [channel.receive(timeout) for _ in range(n)]


def within(call: Callable[[], T], what: str, timeout: float = WAIT) -> T:
    """``call()``, for a blocking call that has no timeout of its own: run in a daemon thread
    and waited for at most ``timeout`` seconds. Its result, or its exception raised here; the
    test fails (naming ``what`` it waited for) if it is still blocked then, the thread left
    behind."""
    outcome: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:  # noqa: BLE001 - raised again in the test's thread
            error.append(exc)

    thread = threading.Thread(target=run, name=f"within: {what}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        pytest.fail(f"still waiting for {what} after {timeout} s")
    if error:
        raise error[0]
    return outcome[0]


def next_within(messages: Iterator[bytes], timeout: float = WAIT) -> bytes:
    """``next(messages)`` (the spec's blocking iterator, which has no timeout), failing the test
    if no message comes within ``timeout``."""
    return within(lambda: next(messages), "the iterator's next message", timeout)


def read_to_end(messages: Iterator[bytes], timeout: float = WAIT) -> list[bytes]:
    """``list(messages)``: what the iterator yields until it ends, failing the test if it has not
    ended within ``timeout``."""
    return within(lambda: list(messages), "the iterator to end", timeout)
