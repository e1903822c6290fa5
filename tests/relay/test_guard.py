"""Revocation and expiry end every streaming call, publishes included, through a real ``static
serve`` (its token checks and revocation checks), on both stores and across relays on
PostgreSQL. The Rust conformance tests (``crates/relay/tests/service_guard.rs``) cover each
streaming RPC with a fake verifier."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.relay import mls_vectors as mls
from tests.relay.client import Relay, pb, status_of
from tests.support.api import Api
from tests.support.postgres import PostgresCluster
from tests.support.server import ServerProcess

CHANNEL = "acme/agents/guarded"
Start = Callable[..., ServerProcess]
NO_LIMITS = ("--signup-rate", "off", "--key-rate", "off")
#: The issue's bound, and a little for the revocation check's round (every 0.5 s).
SOON = 1.5


def _key_id(api: Api, key: str) -> str:
    (only,) = [k for k in api.keys(key) if key.startswith(k["key_prefix"])]
    return str(only["id"])


class _Publishing:
    """A PublishBatches (or PublishStream) call fed one message every 50 ms from a thread,
    its answers read by another: ``accepted`` holds when each answer came, ``error`` how the
    call ended."""

    def __init__(self, relay: Relay, *, batches: bool) -> None:
        self._requests: queue.Queue[Any] = queue.Queue()
        self.accepted: list[float] = []
        self.error: grpc.RpcError | None = None
        self.ended = threading.Event()
        self._stop = threading.Event()
        self._batches = batches
        method = relay.stub.PublishBatches if batches else relay.stub.PublishStream
        self._call = method(self._iterate(), timeout=30, metadata=relay.metadata)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._feeder = threading.Thread(target=self._feed, daemon=True)

    def _iterate(self) -> Iterator[Any]:
        while not self._stop.is_set():
            try:
                yield self._requests.get(timeout=0.1)
            except queue.Empty:
                continue

    def _request(self, n: int) -> Any:
        publish = pb.PublishRequest(
            channel=CHANNEL, message=mls.application(CHANNEL, 0, b"guarded %d" % n)
        )
        return pb.PublishBatchRequest(requests=[publish]) if self._batches else publish

    def _read(self) -> None:
        try:
            for _ in self._call:
                self.accepted.append(time.monotonic())
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.ended.set()

    def _feed(self) -> None:
        n = 1
        while not self.ended.is_set() and not self._stop.is_set():
            self._requests.put(self._request(n))
            n += 1
            time.sleep(0.05)

    def first(self) -> None:
        """One publish answered: the call is live."""
        self._requests.put(self._request(0))
        deadline = time.monotonic() + 10
        while not self.accepted:
            assert time.monotonic() < deadline, f"no answer: {self.error}"
            time.sleep(0.01)

    def keep_publishing(self) -> None:
        self._feeder.start()

    def close(self) -> None:
        self._stop.set()
        self._call.cancel()


def _ends_within(publishing: _Publishing, since: float, reason: str) -> None:
    assert publishing.ended.wait(5), "the call is still open 5 s after the key's end"
    assert publishing.error is not None
    code, details, _ = status_of(publishing.error)
    assert code == grpc.StatusCode.UNAUTHENTICATED and reason in details, (code, details)
    late = [at - since for at in publishing.accepted if at - since > SOON]
    assert not late, f"publishes accepted {late} s after the key's end"
    assert publishing.accepted[-1] - since < SOON


@pytest.mark.parametrize("batches", [True, False], ids=["PublishBatches", "PublishStream"])
def test_revoking_a_key_ends_its_publish_calls(start_server: Start, batches: bool) -> None:
    server = start_server(*NO_LIMITS)
    api = Api(server.http_url)
    owner = api.signup()
    doomed_key = api.create_key(owner.key, name="doomed")["key"]
    with (
        Relay(server.relay_url, api.token(owner.key)) as creator,
        Relay(server.relay_url, api.token(doomed_key)) as doomed,
    ):
        creator.create(CHANNEL)
        publishing = _Publishing(doomed, batches=batches)
        try:
            publishing.first()
            publishing.keep_publishing()
            time.sleep(0.2)
            revoked_at = time.monotonic()
            assert api.revoke(owner.key, _key_id(api, doomed_key)).status_code == 204
            _ends_within(publishing, revoked_at, "revoked")
        finally:
            publishing.close()
        # The account's other key is untouched.
        assert creator.publish(CHANNEL, mls.application(CHANNEL, 0, b"still")).seq > 1
    api.close()


def test_an_expired_token_ends_a_publish_call(start_server: Start) -> None:
    server = start_server(*NO_LIMITS, "--token-ttl", "3")
    api = Api(server.http_url)
    owner = api.signup()
    token = api.token(owner.key)
    issued = time.monotonic()
    with Relay(server.relay_url, token) as relay:
        relay.create(CHANNEL)
        publishing = _Publishing(relay, batches=True)
        try:
            publishing.first()
            publishing.keep_publishing()
            # The token's `exp` is whole seconds: it expires 2-3 s after it was issued.
            _ends_within(publishing, issued + 3, "expired")
        finally:
            publishing.close()
    api.close()


@pytest.fixture
def two_relays(tmp_path: Path, postgres_cluster: PostgresCluster) -> Iterator[list[ServerProcess]]:
    """Two ``static serve`` processes on one fresh PostgreSQL database."""
    url = postgres_cluster.create_database()
    started: list[ServerProcess] = []
    try:
        for n in range(2):
            server = ServerProcess(tmp_path / f"node{n}", url, list(NO_LIMITS))
            started.append(server.start())
        yield started
    finally:
        for server in started:
            server.kill()


def test_a_revocation_on_one_relay_ends_publish_calls_on_another(
    two_relays: list[ServerProcess],
) -> None:
    first, second = two_relays
    api = Api(first.http_url)
    owner = api.signup()
    doomed_key = api.create_key(owner.key, name="doomed")["key"]
    with (
        Relay(first.relay_url, api.token(owner.key)) as creator,
        Relay(second.relay_url, api.token(doomed_key)) as doomed,
    ):
        creator.create(CHANNEL)
        publishing = _Publishing(doomed, batches=True)
        try:
            publishing.first()
            publishing.keep_publishing()
            revoked_at = time.monotonic()
            # Revoked through the first server's API; the call is on the second relay.
            assert api.revoke(owner.key, _key_id(api, doomed_key)).status_code == 204
            _ends_within(publishing, revoked_at, "revoked")
        finally:
            publishing.close()
    api.close()
