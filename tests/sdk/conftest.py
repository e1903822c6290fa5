"""Fixtures of the SDK tests: real ``static serve`` processes and real clients over them."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from static_sdk import Channel, StaticClient
from tests.support.server import ServerProcess

__all__ = ["Clients", "channel_name", "receive_n"]

#: Upper bound of any single wait in these tests (nothing may hang).
WAIT = 20.0


@pytest.fixture
def backend() -> str:
    """SQLite only here; modules that need both backends override this fixture."""
    return "sqlite"


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
