"""Request/reply: ``Channel.request`` gets the first reply another member sends through
``Channel.requests`` / ``Request.reply``; each request gets exactly one reply across timeouts,
crashes of the requester or the responder, and a reply sent twice; requests and replies never
show up among the channel's messages."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from static_sdk import Channel, InternalError, Message, Request, StaticClient, TransportError
from tests.sdk.conftest import WAIT, Clients, channel_name, receive_n, within
from tests.support.process import LineProcess
from tests.support.server import ServerProcess

_EMPTY = 1


def _serve(channel: Channel, answer: Callable[[Request], bytes], count: int | None = None) -> None:
    """Reply to the requests on ``channel`` with ``answer(request)``, ``count`` of them (or
    until the channel ends), in a daemon thread."""

    def run() -> None:
        for served, request in enumerate(channel.requests(), start=1):
            request.reply(answer(request))
            if count is not None and served == count:
                return

    threading.Thread(target=run, name="responder", daemon=True).start()


def _no_request(channel: Channel, wait: float = 1.0) -> None:
    """No further request reaches ``channel`` within ``wait`` seconds."""
    code, fields = channel._native.next_request(wait)
    assert code == _EMPTY, f"an unexpected request: {fields!r}"


def test_request_is_public() -> None:
    import static.sdk
    import static_sdk

    for module in (static.sdk, static_sdk):
        for name in ("Request", "RequestIterator", "AsyncRequestIterator"):
            assert name in module.__all__
            assert getattr(module, name).__doc__


def test_a_request_gets_its_reply_with_the_responders_identity(
    relay: ServerProcess, clients: Clients
) -> None:
    alices, bobs = clients.pair(relay)
    seen: list[Request] = []

    def answer(request: Request) -> bytes:
        seen.append(request)
        return b"re:" + request.payload

    _serve(bobs, answer, count=1)
    reply = alices.request(b"ping", WAIT)
    assert isinstance(reply, Message)
    assert reply.payload == b"re:ping"
    assert reply.sender == b"bob"
    assert reply.account == ""  # the anonymous account, as the relay attests it
    assert reply.seq > 0 and reply.epoch >= 1
    [request] = seen
    assert (request.payload, request.sender, request.account) == (b"ping", b"alice", "")
    # An empty request and an empty reply are fine too.
    _serve(bobs, lambda _: b"", count=1)
    assert alices.request(b"", WAIT).payload == b""


def test_requests_and_replies_are_not_messages(relay: ServerProcess, clients: Clients) -> None:
    alices, bobs = clients.pair(relay)
    _serve(bobs, lambda r: b"re:" + r.payload, count=1)
    alices.send(b"one")
    assert alices.request(b"question", WAIT).payload == b"re:question"
    alices.send(b"two")
    bobs.send(b"three")
    # Bob reads exactly the plain messages, Alice exactly Bob's plain message.
    assert receive_n(bobs, 2) == [b"one", b"two"]
    assert alices.receive(WAIT) == b"three"
    with pytest.raises(TimeoutError):
        bobs.receive(0.5)
    with pytest.raises(TimeoutError):
        alices.receive(0.2)
    assert bobs.pending() == 0 and alices.pending() == 0


def test_concurrent_requests_each_get_their_own_reply(
    relay: ServerProcess, clients: Clients
) -> None:
    alices, bobs = clients.pair(relay)
    _serve(bobs, lambda r: b"re:" + r.payload)
    replies: dict[int, bytes] = {}

    def ask(i: int) -> None:
        replies[i] = alices.request(b"q%d" % i, WAIT).payload

    threads = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT)
    assert replies == {i: b"re:q%d" % i for i in range(8)}
    # The same payload from two threads at once: two requests, two replies.
    same: list[bytes] = []
    pair = [
        threading.Thread(target=lambda: same.append(alices.request(b"same", WAIT).payload))
        for _ in range(2)
    ]
    for thread in pair:
        thread.start()
    for thread in pair:
        thread.join(WAIT)
    assert same == [b"re:same", b"re:same"]


def test_a_retry_after_a_timeout_is_the_same_request(
    relay: ServerProcess, clients: Clients
) -> None:
    alices, bobs = clients.pair(relay)
    requests = bobs.requests()
    with pytest.raises(TimeoutError):
        alices.request(b"slow", 0.5)
    # The responder got it, and is slow: the requester asks again meanwhile.
    request = within(lambda: next(requests), "the request")
    assert request.payload == b"slow"
    retried: list[Message] = []
    retry = threading.Thread(target=lambda: retried.append(alices.request(b"slow", WAIT)))
    retry.start()
    time.sleep(0.5)
    request.reply(b"done")
    retry.join(WAIT)
    assert [m.payload for m in retried] == [b"done"]
    # One request only, and the next call with that payload is a new request.
    _no_request(bobs)
    _serve(bobs, lambda r: b"again", count=1)
    assert alices.request(b"slow", WAIT).payload == b"again"


def test_a_requester_killed_while_waiting_gets_the_one_reply_after_a_restart(
    relay: ServerProcess, clients: Clients, tmp_path: Path
) -> None:
    name = channel_name()
    alice_dir = tmp_path / "alice-data"
    alice, bob = clients(relay, b"alice", data_dir=alice_dir), clients(relay, b"bob")
    bobs = bob.join_channel(name, alice.create_channel(name).add_member(bob.generate_key_package()))
    alice.close()
    requester = LineProcess(
        "tests.sdk.request_agent", relay.relay_url, str(alice_dir), "alice", name, "crash?"
    )
    try:
        assert requester.line(WAIT) == "sending"
        requests = bobs.requests()
        request = within(lambda: next(requests), "the request")
        assert (request.payload, request.sender) == (b"crash?", b"alice")
    finally:
        requester.end(kill=True, timeout=WAIT)
    request.reply(b"answer")
    # The same data_dir reopened: the same payload asked again is the request that was sent.
    alice = clients(relay, b"alice", data_dir=alice_dir)
    reply = alice.open_channel(name).request(b"crash?", WAIT)
    assert (reply.payload, reply.sender) == (b"answer", b"bob")
    _no_request(bobs)


def test_a_requester_killed_before_the_reply_came_asks_again_once(
    relay: ServerProcess, clients: Clients, tmp_path: Path
) -> None:
    name = channel_name()
    alice_dir = tmp_path / "alice-data"
    alice, bob = clients(relay, b"alice", data_dir=alice_dir), clients(relay, b"bob")
    bobs = bob.join_channel(name, alice.create_channel(name).add_member(bob.generate_key_package()))
    alice.close()
    requester = LineProcess(
        "tests.sdk.request_agent", relay.relay_url, str(alice_dir), "alice", name, "again?"
    )
    requests = bobs.requests()
    try:
        assert requester.line(WAIT) == "sending"
        request = within(lambda: next(requests), "the request")
    finally:
        requester.end(kill=True, timeout=WAIT)
    # Asked again (the request sent again, a duplicate the relay does not append) before the
    # responder replies.
    alice = clients(relay, b"alice", data_dir=alice_dir)
    alices = alice.open_channel(name)
    got: list[Message] = []
    asking = threading.Thread(target=lambda: got.append(alices.request(b"again?", WAIT)))
    asking.start()
    _no_request(bobs, 0.5)
    request.reply(b"once")
    asking.join(WAIT)
    assert [m.payload for m in got] == [b"once"]
    _no_request(bobs)


def test_a_request_not_replied_to_is_offered_again_after_the_responder_restarts(
    relay: ServerProcess, clients: Clients, tmp_path: Path
) -> None:
    name = channel_name()
    bob_dir = tmp_path / "bob-data"
    alice, bob = clients(relay, b"alice"), clients(relay, b"bob", data_dir=bob_dir)
    alices = alice.create_channel(name)
    bobs = bob.join_channel(name, alices.add_member(bob.generate_key_package()))
    got: list[Message] = []
    asking = threading.Thread(target=lambda: got.append(alices.request(b"crash", WAIT)))
    asking.start()
    requests = bobs.requests()
    first = within(lambda: next(requests), "the request")
    assert first.payload == b"crash"
    # Handed out once per opening.
    _no_request(bobs, 0.3)
    bob.close()  # gone before replying
    bob = clients(relay, b"bob", data_dir=bob_dir)
    bobs = bob.open_channel(name)
    again = within(lambda: next(iter(bobs.requests())), "the request again")
    assert (again.payload, again.sender) == (b"crash", b"alice")
    again.reply(b"after restart")
    asking.join(WAIT)
    assert [m.payload for m in got] == [b"after restart"]
    # Replied: not offered again.
    bob.close()
    bob = clients(relay, b"bob", data_dir=bob_dir)
    _no_request(bob.open_channel(name), 0.5)


def test_a_second_reply_appends_nothing(relay: ServerProcess, clients: Clients) -> None:
    alices, bobs = clients.pair(relay)
    got: list[Message] = []
    asking = threading.Thread(target=lambda: got.append(alices.request(b"q", WAIT)))
    asking.start()
    request = within(lambda: next(iter(bobs.requests())), "the request")
    request.reply(b"first")
    request.reply(b"second")
    asking.join(WAIT)
    [reply] = got
    assert reply.payload == b"first"
    # The next entry of the log is Bob's next message: the second reply was not appended.
    bobs.send(b"next")
    message = alices.receive_message(WAIT)
    assert (message.payload, message.seq) == (b"next", reply.seq + 1)


def test_payload_limits(relay: ServerProcess, clients: Clients) -> None:
    from static_sdk import MAX_PAYLOAD

    alices, _ = clients.pair(relay)
    with pytest.raises(TransportError, match="exceeds the maximum"):
        alices.request(b"x" * (MAX_PAYLOAD - 15), 1)


def test_close_ends_a_waiting_iteration_and_a_waiting_request(
    relay: ServerProcess, clients: Clients
) -> None:
    alices, bobs = clients.pair(relay)
    ended = threading.Event()

    def iterate() -> None:
        for _ in bobs.requests():
            pass
        ended.set()

    threading.Thread(target=iterate, daemon=True).start()
    failure: list[BaseException] = []

    def ask() -> None:
        try:
            alices.request(b"nobody answers", WAIT)
        except BaseException as exc:  # noqa: BLE001 - checked below
            failure.append(exc)

    asker = threading.Thread(target=ask, daemon=True)
    asker.start()
    time.sleep(0.5)
    started = time.monotonic()
    bobs.close()
    assert ended.wait(2.0), "requests() still waiting after close()"
    alices.close()
    asker.join(2.0)
    assert not asker.is_alive(), "request() still waiting after close()"
    assert time.monotonic() - started < 3.0
    [error] = failure
    assert isinstance(error, InternalError) and "closed" in str(error)


async def _async_pair(relay: ServerProcess, clients: Clients) -> tuple[Channel, Channel]:
    alice = await StaticClient.create_async(relay.relay_url, clients.tmp_path / "a", b"alice")
    bob = await StaticClient.create_async(relay.relay_url, clients.tmp_path / "b", b"bob")
    clients.opened += [alice, bob]
    name = channel_name()
    alices = await alice.create_channel_async(name)
    welcome = await alices.add_member_async(await bob.generate_key_package_async())
    return alices, await bob.join_channel_async(name, welcome)


async def _respond(bobs: Channel, count: int) -> None:
    served = 0
    async for request in bobs.requests_async():
        await request.reply_async(b"re:" + request.payload)
        served += 1
        if served == count:
            return


async def test_trio_request_reply(relay: ServerProcess, clients: Clients) -> None:
    alices, bobs = await _async_pair(relay, clients)
    got: list[bytes] = []

    async def ask(i: int) -> None:
        got.append((await alices.request_async(b"t%d" % i, WAIT)).payload)

    with trio.fail_after(WAIT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_respond, bobs, 3)
            for i in range(3):
                nursery.start_soon(ask, i)
    assert sorted(got) == [b"re:t0", b"re:t1", b"re:t2"]
    with trio.fail_after(WAIT), pytest.raises(TimeoutError):
        await alices.request_async(b"nobody", 0.3)
    # Closing the channel ends a waiting async iteration.
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_respond, bobs, 1)
            await trio.sleep(0.2)
            await bobs.close_async()


def test_asyncio_request_reply(relay: ServerProcess, clients: Clients) -> None:
    async def main() -> None:
        alices, bobs = await _async_pair(relay, clients)
        async with asyncio.timeout(WAIT):
            responder = asyncio.create_task(_respond(bobs, 2))
            replies = await asyncio.gather(
                alices.request_async(b"a0", WAIT), alices.request_async(b"a1", WAIT)
            )
            await responder
        assert [m.payload for m in replies] == [b"re:a0", b"re:a1"]
        assert all(m.sender == b"bob" for m in replies)
        with pytest.raises(TimeoutError):
            await alices.request_async(b"nobody", 0.3)

    asyncio.run(main())
