"""SubscribeMany against a real ``static serve`` process, on both store backends, with grpcio."""

from __future__ import annotations

import itertools
import queue
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from tests.relay import mls_vectors as mls
from tests.relay.client import Relay, StreamReader, pb, status_of
from tests.support.api import Api
from tests.support.server import ServerProcess

Start = Callable[..., ServerProcess]
NO_LIMITS = ("--signup-rate", "off", "--key-rate", "off")
CODES = {code.value[0]: code for code in grpc.StatusCode}
#: The answer to an add: the head seq of a live follow, or the refusal's (code, message).
Answer = int | tuple[grpc.StatusCode, str]


def name(i: int) -> str:
    return f"acme/many/c{i}"


class Many(StreamReader):
    """A SubscribeMany call: requests queued by the test, responses read by a thread."""

    def __init__(self, relay: Relay, timeout: float = 60.0) -> None:
        self._requests: queue.Queue[Any] = queue.Queue()
        self.entries: dict[str, list[Any]] = {}
        self.answers: dict[str, list[Answer]] = {}
        super().__init__(
            relay.stub.SubscribeMany(self._send(), timeout=timeout, metadata=relay.metadata)
        )

    def _send(self) -> Iterator[Any]:
        while (request := self._requests.get()) is not None:
            yield request

    def _take(self, response: Any) -> None:
        kind = response.WhichOneof("item")
        if kind == "entries":
            self.entries.setdefault(response.channel, []).extend(response.entries.entries)
        elif kind == "keep_alive" and not response.channel:
            self.keepalives += 1
        elif kind == "keep_alive":
            answer: Answer = response.keep_alive.head_seq
            self.answers.setdefault(response.channel, []).append(answer)
        elif kind == "ended":
            refusal = (CODES[response.ended.code], response.ended.message)
            self.answers.setdefault(response.channel, []).append(refusal)

    def add(self, channel: str, *, after_seq: int = 0, from_epoch: int | None = None) -> None:
        request = (
            pb.SubscribeRequest(channel=channel, from_epoch=from_epoch)
            if from_epoch is not None
            else pb.SubscribeRequest(channel=channel, after_seq=after_seq)
        )
        self._requests.put(pb.SubscribeManyRequest(add=request))

    def remove(self, channel: str) -> None:
        self._requests.put(pb.SubscribeManyRequest(remove=channel))

    def wait(self, done: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
        with self._changed:
            self._changed.wait_for(lambda: done() or self.ended.is_set(), timeout)
            assert done(), f"{what} (error: {self.error})"

    def answer(self, channel: str, n: int = 1) -> Answer:
        """The answer to the ``n``th add of ``channel``."""
        self.wait(lambda: len(self.answers.get(channel, ())) >= n, f"no answer for {channel}")
        return self.answers[channel][n - 1]

    def seqs(self, channel: str) -> list[int]:
        return [e.seq for e in self.entries.get(channel, ())]

    def wait_for(self, channel: str, count: int) -> list[Any]:
        self.wait(lambda: len(self.seqs(channel)) >= count, f"too few entries on {channel}")
        return list(self.entries[channel])

    def cancel(self) -> None:
        self._requests.put(None)
        self.call.cancel()
        self.ended.wait(5)


@pytest.fixture
def relay(start_server: Start) -> Iterator[Relay]:
    with Relay(start_server("--allow-anonymous").relay_url) as client:
        yield client


def test_two_channels_on_one_stream_match_their_own_subscriptions(relay: Relay) -> None:
    a, b = name(1), name(2)
    relay.create(a)
    relay.create(b)
    relay.publish(a, mls.application(a, 0, b"a0"))
    many = Many(relay)
    many.add(a)
    many.add(b)
    assert many.answer(a) == 1
    assert many.answer(b) == 0
    for i in range(1, 10):
        relay.publish(a, mls.application(a, 0, b"a%d" % i))
        relay.publish(b, mls.application(b, 0, b"b%d" % i))
    for channel in (a, b):
        got = many.wait_for(channel, 10 if channel == a else 9)
        own = relay.subscribe(channel)
        expected = own.wait_for(len(got))
        own.cancel()
        assert [(e.seq, e.message) for e in got] == [(e.seq, e.message) for e in expected]
    assert many.seqs(a) == list(range(1, 11))
    many.cancel()


def test_an_unknown_channel_is_ended_and_the_others_go_on(relay: Relay) -> None:
    a = name(1)
    relay.create(a)
    many = Many(relay)
    many.add("acme/many/unknown")
    many.add("not a name")
    many.add(a)
    assert many.answer("acme/many/unknown") == (
        grpc.StatusCode.NOT_FOUND,
        "no channel 'acme/many/unknown'",
    )
    refused = many.answer("not a name")
    assert isinstance(refused, tuple) and refused[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert many.answer(a) == 0
    relay.publish(a, mls.application(a, 0))
    assert [e.seq for e in many.wait_for(a, 1)] == [1]
    # A from_epoch the channel has not reached is refused as Subscribe refuses it.
    many.add(a, from_epoch=3)
    assert many.answer(a, 2) == (
        grpc.StatusCode.NOT_FOUND,
        f"channel '{a}' has no epoch 3 (it is at 0)",
    )
    # Removed, then added again: from the new cursor.
    many.remove(a)
    relay.publish(a, mls.application(a, 0, b"2"))
    many.add(a, after_seq=1)
    assert many.answer(a, 3) == 2
    assert many.seqs(a)[:1] == [1]
    assert many.wait_for(a, 2)[-1].seq == 2
    many.cancel()


def test_other_accounts_channels_are_refused_and_revocation_ends_the_stream(
    start_server: Start,
) -> None:
    """The premise changed: another account's channel was NOT_FOUND; an account with no bound
    leaf in it is now refused with PERMISSION_DENIED (the channel's existence is not hidden)."""
    server = start_server(*NO_LIMITS)
    api = Api(server.http_url)
    alice, bob = api.signup(), api.signup()
    channel = "acme/agents/chat"
    with (
        Relay(server.relay_url, api.token(alice.key)) as relay_a,
        Relay(server.relay_url, api.token(bob.key)) as relay_b,
    ):
        relay_a.create(channel)
        hidden = Many(relay_b)
        hidden.add(channel)
        assert hidden.answer(channel) == (
            grpc.StatusCode.PERMISSION_DENIED,
            f"this account is not a member of channel '{channel}' (no leaf of its group is bound"
            " to it)",
        )
        own = Many(relay_a)
        own.add(channel)
        assert own.answer(channel) == 0
        relay_a.publish(channel, mls.application(channel, 0))
        assert [e.seq for e in own.wait_for(channel, 1)] == [1]
        (key,) = [k for k in api.keys(alice.key) if alice.key.startswith(k["key_prefix"])]
        revoked_at = time.monotonic()
        assert api.revoke(alice.key, str(key["id"])).status_code == 204
        error = own.wait_end(timeout=5)
        assert error is not None
        code, details, _ = status_of(error)
        assert code == grpc.StatusCode.UNAUTHENTICATED and "revoked" in details
        assert time.monotonic() - revoked_at < 1.5
        # Bob's stream is untouched.
        assert not hidden.ended.is_set()
        hidden.cancel()
    api.close()


def test_hundreds_of_channels_on_one_stream(relay: Relay) -> None:
    count = 500
    channels = [name(i) for i in range(count)]
    for channel in channels:
        relay.create(channel)
    many = Many(relay)
    started = time.monotonic()
    for channel in channels:
        many.add(channel)
    many.wait(lambda: len(many.answers) == count, "not every channel went live", timeout=30)
    assert all(answers == [0] for answers in many.answers.values())
    live = time.monotonic() - started
    batches = [
        [pb.PublishRequest(channel=c, message=mls.application(c, 0)) for c in channels[i : i + 100]]
        for i in range(0, count, 100)
    ]
    assert len(relay.publish_batches(batches)) == 5
    many.wait(
        lambda: all(many.seqs(c) == [1] for c in channels),
        "not every channel got its entry",
        timeout=30,
    )
    assert live < 20, f"{count} adds took {live:.1f}s"
    many.cancel()


def test_adds_beyond_the_cap_are_refused(start_server: Start) -> None:
    server = start_server("--allow-anonymous", "--relay-max-subscriptions", "2")
    with Relay(server.relay_url) as relay:
        for i in range(3):
            relay.create(name(i))
        many = Many(relay)
        for i in range(3):
            many.add(name(i))
        assert [many.answer(name(i)) for i in range(2)] == [0, 0]
        assert many.answer(name(2)) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "this stream follows 2 channels already, the most it may",
        )
        many.remove(name(0))
        many.add(name(2))
        assert many.answer(name(2), 2) == 0
        many.cancel()


def test_an_accounts_follows_are_bounded_over_its_streams(start_server: Start) -> None:
    server = start_server("--allow-anonymous", "--relay-max-follows", "2")
    with Relay(server.relay_url) as relay:
        for i in range(3):
            relay.create(name(i))
        first, second = Many(relay), Many(relay)
        first.add(name(0))
        assert first.answer(name(0)) == 0
        second.add(name(1))
        second.add(name(2))
        assert second.answer(name(1)) == 0
        assert second.answer(name(2)) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "this account follows 2 channels already on its SubscribeMany streams, the most it may",
        )
        # The remove gives the place back once the first stream has read it.
        first.remove(name(0))
        deadline = time.monotonic() + 10
        for attempt in itertools.count(2):
            second.add(name(2))
            answer = second.answer(name(2), attempt)
            if answer == 0:
                break
            assert isinstance(answer, tuple) and answer[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert time.monotonic() < deadline, "the removed follow's place was not given back"
            time.sleep(0.05)
        first.cancel()
        second.cancel()
