"""The binding's side of the token callback: an expiry the clock cannot hold is no deadline,
never a panic (an ``exp`` of 1e20 made ``call_verify`` panic: INTERNAL to the caller); the key's
channel patterns reach the relay (issue 30)."""

from __future__ import annotations

import math
import uuid
from pathlib import Path

import grpc
import pytest

from static._native.relay import RelayServer
from static.store import relay_database, sqlite_url
from tests.relay.client import Relay, status_of
from tests.support.server import ServerProcess


@pytest.mark.parametrize("expires_at", [1e20, 2.0**64, math.inf, math.nan, -1.0, None])
def test_an_unrepresentable_expiry_is_no_deadline(tmp_path: Path, expires_at: float | None) -> None:
    db = tmp_path / "static.db"
    # A real server creates the relay's tables, then leaves the file to this relay.
    server = ServerProcess(tmp_path / "server", f"sqlite:///{db}").start()
    assert server.stop() == 0
    account, key = str(uuid.uuid4()), str(uuid.uuid4())
    relay = RelayServer(
        host="127.0.0.1",
        port=0,
        database=relay_database(sqlite_url(str(db))),
        verify=lambda token, peer: (account, key, expires_at),
        allow_anonymous=False,
        settings={},
    )
    try:
        with Relay(f"grpc://127.0.0.1:{relay.port}", "a.b.c") as client:
            with pytest.raises(grpc.RpcError) as refused:
                client.list_members("nobody/has/this")
            # Authenticated (the channel is unknown), not INTERNAL.
            assert status_of(refused.value)[0] == grpc.StatusCode.NOT_FOUND
    finally:
        relay.shutdown()


@pytest.mark.parametrize(
    ("channels", "code", "text"),
    [
        # Every channel: authenticated, the channel unknown.
        (None, grpc.StatusCode.NOT_FOUND, None),
        (["nobody/has/*"], grpc.StatusCode.NOT_FOUND, None),
        # Outside the key's patterns: refused before the channel is looked up, naming them.
        (
            ["acme/ops/*", "acme/x/y"],
            grpc.StatusCode.PERMISSION_DENIED,
            "channel nobody/has/this is outside this key's channels (acme/ops/*, acme/x/y)",
        ),
        # Patterns the relay cannot read refuse the call: a restriction is never dropped.
        (["acme/**/x"], grpc.StatusCode.UNAUTHENTICATED, None),
    ],
)
def test_the_verify_answer_carries_the_keys_channel_patterns(
    tmp_path: Path, channels: list[str] | None, code: grpc.StatusCode, text: str | None
) -> None:
    db = tmp_path / "static.db"
    server = ServerProcess(tmp_path / "server", f"sqlite:///{db}").start()
    assert server.stop() == 0
    account, key = str(uuid.uuid4()), str(uuid.uuid4())
    relay = RelayServer(
        host="127.0.0.1",
        port=0,
        database=relay_database(sqlite_url(str(db))),
        verify=lambda token, peer: (account, key, None, channels),
        allow_anonymous=False,
        settings={},
    )
    try:
        with Relay(f"grpc://127.0.0.1:{relay.port}", "a.b.c") as client:
            with pytest.raises(grpc.RpcError) as refused:
                client.list_members("nobody/has/this")
            got_code, got_text, _ = status_of(refused.value)
            assert got_code == code
            if text is not None:
                assert got_text == text
    finally:
        relay.shutdown()
