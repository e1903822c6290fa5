"""The async variants, under trio (pytest-trio) and asyncio: no blocked event loop, no thread per
waiting iterator, cancellation leaves the channel usable."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
import time

import trio

from static_sdk import Channel, SendHandle, StaticClient
from tests.sdk.conftest import WAIT, Clients, channel_name
from tests.support.server import ServerProcess


async def _pair(relay: ServerProcess, clients: Clients) -> tuple[Channel, Channel]:
    alice = await StaticClient.create_async(relay.relay_url, clients.tmp_path / "a", b"alice")
    bob = await StaticClient.create_async(relay.relay_url, clients.tmp_path / "b", b"bob")
    clients.opened += [alice, bob]
    name = channel_name()
    alices = await alice.create_channel_async(name)
    welcome = await alices.add_member_async(await bob.generate_key_package_async())
    return alices, await bob.join_channel_async(name, welcome)


async def test_trio_flow_and_cancellation(relay: ServerProcess, clients: Clients) -> None:
    alices, bobs = await _pair(relay, clients)
    await alices.send_async(b"hello")
    with trio.fail_after(WAIT):
        assert await bobs.receive_async() == b"hello"
    # A waiting iterator cancelled: nothing consumed, the channel and the iterator still work.
    iterator = bobs.messages_async()
    with trio.move_on_after(0.2) as scope:
        await iterator.__anext__()
    assert scope.cancelled_caught
    await alices.send_async(b"after cancel")
    with trio.fail_after(WAIT):
        assert await iterator.__anext__() == b"after cancel"
    # Many waiting iterators cost no thread, and the event loop keeps running meanwhile.
    threads_before = threading.active_count()
    ticks = 0
    got: list[bytes] = []

    async def wait_one(channel: Channel) -> None:
        got.append(await channel.receive_async())

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await trio.sleep(0.01)

    with trio.fail_after(WAIT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tick)
            waiters = trio.open_nursery()
            async with waiters as inner:
                for _ in range(20):
                    inner.start_soon(wait_one, bobs)
                await trio.sleep(0.3)
                assert threading.active_count() <= threads_before + 1
                for i in range(20):
                    await alices.send_async(b"w%d" % i)
            nursery.cancel_scope.cancel()
    assert sorted(got) == sorted(b"w%d" % i for i in range(20))
    assert ticks > 10
    # async for, and the rest of the async surface.
    with trio.fail_after(WAIT):
        await bobs.send_async(b"from bob")
        async for message in alices.messages_async():
            assert message == b"from bob"
            break
        await bobs.rotate_keys_async()
        assert sorted(await alices.members_async()) == [b"alice", b"bob"]
        await alices.close_async()


def test_asyncio_flow_and_cancellation(relay: ServerProcess, clients: Clients) -> None:
    async def main() -> None:
        alices, bobs = await _pair(relay, clients)
        await alices.send_async(b"hello")
        async with asyncio.timeout(WAIT):
            assert await bobs.receive_async() == b"hello"
        iterator = bobs.messages_async()
        task = asyncio.ensure_future(anext(iterator))
        await asyncio.sleep(0.2)
        task.cancel()
        started = time.monotonic()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert time.monotonic() - started < 1
        await alices.send_async(b"after cancel")
        async with asyncio.timeout(WAIT):
            assert await anext(iterator) == b"after cancel"
            await bobs.send_async(b"back")
            async for message in alices.messages_async():
                assert message == b"back"
                break

    asyncio.run(main())


#: Blocking calls that need no twin: properties, ``close`` (has ``close_async``), the
#: iterators (their async forms are ``messages_async``, ``messages_with_sender_async``,
#: ``requests_async`` and ``invitations_async``),
#: ``receive``/``receive_message`` (``receive_async``/``receive_message_async``) and
#: ``SendHandle.done`` (never blocks).
_NO_TWIN = {"messages", "messages_with_sender", "requests", "invitations", "done"}


def test_every_blocking_call_has_an_async_twin() -> None:
    for cls in (StaticClient, Channel, SendHandle):
        names = {n for n in vars(cls) if not n.startswith("_")}
        for name in names:
            if name.endswith("_async") or isinstance(vars(cls)[name], property | classmethod):
                continue
            if name in _NO_TWIN:
                continue
            assert f"{name}_async" in names, f"{cls.__name__}.{name} has no async twin"
            assert inspect.iscoroutinefunction(getattr(cls, f"{name}_async")), name


async def test_trio_state_queries(relay: ServerProcess, clients: Clients) -> None:
    alices, bobs = await _pair(relay, clients)
    await alices.send_async(b"one")
    await alices.send_async(b"two")
    with trio.fail_after(WAIT):
        while await bobs.pending_async() < 2:  # noqa: ASYNC110 - the SDK's state, no event
            await trio.sleep(0.02)
    assert await bobs.pending_async() == bobs.pending() == 2
    await bobs.rotate_keys_async()
    with trio.fail_after(WAIT):
        while await alices.epoch_async() != await bobs.epoch_async():  # noqa: ASYNC110
            await trio.sleep(0.02)
    assert await alices.epoch_async() == bobs.epoch() == 2
    authenticator = await alices.epoch_authenticator_async()
    assert authenticator == await bobs.epoch_authenticator_async() == bobs.epoch_authenticator()


def test_asyncio_state_queries(relay: ServerProcess, clients: Clients) -> None:
    async def main() -> None:
        alices, bobs = await _pair(relay, clients)
        assert await alices.epoch_async() == 1
        assert await bobs.pending_async() == 0
        assert await alices.epoch_authenticator_async() == bobs.epoch_authenticator()

    asyncio.run(main())
