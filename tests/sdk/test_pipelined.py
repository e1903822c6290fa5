"""Pipelined sends (``Channel.send_pipelined`` + ``flush``): every message reaches the other
members once, in the order it was queued, through rate limiting, relay restarts and mixing with
blocking sends; failures are reported, never silent."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest
import trio

from static_sdk import MAX_PAYLOAD, Channel, InternalError, SendHandle, TransportError
from tests.sdk.conftest import WAIT, Clients, receive_n
from tests.support.server import ServerProcess, restartable_args


def _payloads(n: int, prefix: bytes = b"") -> list[bytes]:
    # Varied sizes, so batches are cut by bytes as well as by count.
    return [prefix + b"%06d:" % i + b"x" * (i % 7 * 150) for i in range(n)]


def test_pipelined_messages_arrive_once_in_order(relay: ServerProcess, clients: Clients) -> None:
    alices, bobs = clients.pair(relay)
    payloads = _payloads(3000)
    handles = [alices.send_pipelined(p) for p in payloads]
    assert all(isinstance(h, SendHandle) for h in handles)
    alices.flush(WAIT)
    assert all(h.done() for h in handles)
    for handle in handles[:10]:
        handle.wait(0)
    assert receive_n(bobs, len(payloads)) == payloads
    with pytest.raises(TimeoutError):
        bobs.receive(0.2)


def test_a_blocking_send_waits_for_what_was_pipelined_before(
    relay: ServerProcess, clients: Clients
) -> None:
    alices, bobs = clients.pair(relay)
    expected = []
    for round_ in range(5):
        pipelined = _payloads(200, b"%d/" % round_)
        for p in pipelined:
            alices.send_pipelined(p)
        alices.send(b"blocking %d" % round_)
        expected += [*pipelined, b"blocking %d" % round_]
    assert receive_n(bobs, len(expected)) == expected


def test_rate_limited_pipelined_sends_keep_their_order(
    start_server: Callable[..., ServerProcess], clients: Clients
) -> None:
    # 3,000 messages against 1,000/s: most batches are refused from some item on and sent
    # again after the relay's retry-after; nothing may be lost, repeated or reordered.
    server = start_server("--allow-anonymous", "--relay-publish-rate", "1000")
    alices, bobs = clients.pair(server)
    payloads = _payloads(3000)
    started = time.monotonic()
    for p in payloads:
        alices.send_pipelined(p)
    alices.flush(WAIT * 2)
    assert time.monotonic() - started > 1.0  # the limit did bite
    assert receive_n(bobs, len(payloads)) == payloads


def test_pipelined_sends_ride_out_a_relay_restart(
    start_server: Callable[..., ServerProcess], clients: Clients
) -> None:
    server = start_server(*restartable_args("--allow-anonymous"))
    alices, bobs = clients.pair(server)
    payloads = _payloads(4000)
    sending_done = threading.Event()

    def send() -> None:
        for p in payloads:
            alices.send_pipelined(p)
            if p.startswith(b"001000:"):
                time.sleep(0.2)  # let the restart begin with messages in flight
        sending_done.set()

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    time.sleep(0.1)
    server.restart()
    assert sending_done.wait(WAIT)
    alices.flush(WAIT * 2)
    assert receive_n(bobs, len(payloads)) == payloads


def test_failures_are_reported_never_silent(relay: ServerProcess, clients: Clients) -> None:
    alices, bobs = clients.pair(relay)
    with pytest.raises(TransportError, match=r"^transport error: payload of"):
        alices.send_pipelined(b"x" * (MAX_PAYLOAD + 1))
    with pytest.raises(TypeError):
        alices.send_pipelined("text")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        alices.flush(-1)
    # Queued and closed before they could go: each either made it or fails, and flush says so.
    handles = [alices.send_pipelined(p) for p in _payloads(2000)]
    alices.close()
    outcomes = []
    for handle in handles:
        try:
            handle.wait(WAIT)
            outcomes.append("sent")
        except InternalError:
            outcomes.append("failed")
    assert all(handle.done() for handle in handles)
    # What was sent is a prefix: nothing after a failed message made it.
    sent = outcomes.count("sent")
    assert outcomes == ["sent"] * sent + ["failed"] * (len(handles) - sent)
    assert receive_n(bobs, sent) == _payloads(2000)[:sent]
    with pytest.raises(InternalError, match=r"^runtime error: .*closed"):
        alices.send_pipelined(b"after close")


def test_flush_times_out_while_messages_are_on_their_way(
    start_server: Callable[..., ServerProcess], clients: Clients
) -> None:
    server = start_server("--allow-anonymous", "--relay-publish-rate", "100")
    alices, bobs = clients.pair(server)
    for p in _payloads(300):
        alices.send_pipelined(p)
    with pytest.raises(TimeoutError):
        alices.flush(0.05)
    alices.flush(WAIT)
    assert receive_n(bobs, 300) == _payloads(300)


async def _pipeline_async(alices: Channel, bobs: Channel, n: int) -> list[bytes]:
    payloads = _payloads(n)
    handles = [await alices.send_pipelined_async(p) for p in payloads]
    await handles[-1].wait_async()
    await alices.flush_async()
    return payloads


async def test_trio_pipelined(relay: ServerProcess, clients: Clients) -> None:
    alices, bobs = clients.pair(relay)
    with trio.fail_after(WAIT):
        payloads = await _pipeline_async(alices, bobs, 500)
        assert [await bobs.receive_async() for _ in payloads] == payloads


def test_asyncio_pipelined(relay: ServerProcess, clients: Clients) -> None:
    alices, bobs = clients.pair(relay)

    async def main() -> None:
        payloads = await asyncio.wait_for(_pipeline_async(alices, bobs, 500), WAIT)
        got = [await asyncio.wait_for(bobs.receive_async(), WAIT) for _ in payloads]
        assert got == payloads

    asyncio.run(main())


async def test_a_cancelled_flush_async_returns_promptly_and_loses_nothing(
    start_server: Callable[..., ServerProcess], clients: Clients
) -> None:
    server = start_server("--allow-anonymous", "--relay-publish-rate", "200")
    alices, bobs = clients.pair(server)
    payloads = _payloads(600)
    with trio.fail_after(WAIT):
        for p in payloads:
            await alices.send_pipelined_async(p)
    started = time.monotonic()
    with trio.move_on_after(0.2) as scope:
        await alices.flush_async()
    assert scope.cancelled_caught and time.monotonic() - started < 1.0
    with trio.fail_after(WAIT):
        await alices.flush_async()
        assert [await bobs.receive_async() for _ in payloads] == payloads
