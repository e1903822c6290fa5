"""Request/reply over a channel: ``Request`` and the iterators over received requests.

``Channel.request`` / ``Channel.requests`` (static/sdk/_client.py) use these; the native core
does the work (see docs/sdk.md, Request and reply): a request gets exactly one reply across
retries, reconnections and crashes of either side, and requests and replies never show up among
the channel's messages.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final

import anyio

from static._native import client as native_client

__all__ = [
    "AsyncRequestIterator",
    "Request",
    "RequestIterator",
    "request",
    "request_async",
]

_MESSAGE, _EMPTY, _END = 0, 1, 2

#: How long a blocking request waits at a time for its reply before looking at the clock again.
_WAIT_SLICE: Final[float] = 0.25


class Request:
    """A request another member sent: reply to it once with :meth:`reply`.

    ``sender`` is the requester's identity as MLS authenticated it; ``account`` the account
    that published it as the relay attests it (None when unknown). A request not replied to
    is offered again the next time the channel is opened (after a crash, say).
    """

    __slots__ = ("_channel", "_id", "account", "payload", "sender")

    def __init__(self, channel: native_client.Channel, fields: native_client.RequestFields) -> None:
        request_id, payload, sender, account, _seq, _epoch = fields
        self._channel = channel
        self._id = request_id
        self.payload: bytes = payload
        self.sender: bytes = sender
        self.account: str | None = account

    def reply(self, payload: bytes) -> None:
        """Send ``payload`` as the reply, returning once it is in the channel's log (as
        ``Channel.send`` does). Calling it again sends nothing new: the relay answers the
        second reply as a duplicate of the first, whose payload the requester gets.

        :raises TransportError: the payload is over ``MAX_PAYLOAD - 16`` bytes, or the relay
            cannot be reached.
        """
        self._channel.reply(self._id, _bytes("payload", payload))

    async def reply_async(self, payload: bytes) -> None:
        """Async :meth:`reply` (in a worker thread for its duration)."""
        await anyio.to_thread.run_sync(self.reply, payload)

    def __repr__(self) -> str:
        return f"<Request from {self.sender!r}, {len(self.payload)} bytes>"


def _bytes(name: str, value: object) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    raise TypeError(f"{name} must be bytes, not {type(value).__name__}")


def request(
    channel: native_client.Channel, payload: bytes, timeout: float
) -> native_client.MessageFields:
    """Send a request on ``channel`` and wait up to ``timeout`` seconds for its reply.

    :raises TimeoutError: no reply in time (a later call with the same payload takes the
        request over rather than send a new one).
    """
    deadline = time.monotonic() + timeout
    pending = channel.request(_bytes("payload", payload))
    while True:
        left = deadline - time.monotonic()
        fields = pending.wait(max(0.0, min(left, _WAIT_SLICE)))
        if fields is not None:
            return fields
        if left <= 0:
            raise TimeoutError(f"no reply on {channel.name!r} within {timeout} s")


async def request_async(
    channel: native_client.Channel,
    payload: bytes,
    timeout: float,  # noqa: ASYNC109 - Channel.request_async's (the API's)
) -> native_client.MessageFields:
    """Async :func:`request`: the request is sent in a worker thread, the reply awaited on the
    channel's readiness socket (no thread)."""
    payload = _bytes("payload", payload)
    pending = await anyio.to_thread.run_sync(channel.request, payload)
    waker = channel.waker()
    with anyio.move_on_after(timeout):
        while True:
            waker.drain()
            fields = pending.poll()
            if fields is not None:
                return fields
            await anyio.wait_readable(waker.fileno())
    # The reply may have come as the time ran out.
    fields = pending.poll()
    if fields is not None:
        return fields
    raise TimeoutError(f"no reply on {channel.name!r} within {timeout} s")


class RequestIterator:
    """Blocking iterator over the requests other members send on a channel (each handed out
    once per opening of the channel). Ends when the channel is closed or we are removed."""

    def __init__(self, channel: native_client.Channel) -> None:
        self._channel = channel

    def __iter__(self) -> RequestIterator:
        return self

    def __next__(self) -> Request:
        while True:
            code, fields = self._channel.next_request(_WAIT_SLICE)
            if code == _MESSAGE and fields is not None:
                return Request(self._channel, fields)
            if code == _END:
                raise StopIteration


class AsyncRequestIterator:
    """Async :class:`RequestIterator`, for trio and asyncio: waits on the channel's readiness
    socket (no thread); cancelling a waiting ``__anext__`` consumes nothing."""

    def __init__(self, channel: native_client.Channel) -> None:
        self._channel = channel
        self._waker: native_client.Waker | None = channel.waker()

    def __aiter__(self) -> AsyncRequestIterator:
        return self

    async def __anext__(self) -> Request:
        poll: Callable[[], tuple[int, native_client.RequestFields | None]]
        poll = self._channel.poll_request
        while True:
            code, fields = poll()
            if code == _MESSAGE and fields is not None:
                return Request(self._channel, fields)
            waker = self._waker
            if code == _END or waker is None:
                self.close()
                raise StopAsyncIteration
            # Drain, then look again, then sleep: a wake-up between the two looks is not lost.
            waker.drain()
            code, fields = poll()
            if code == _MESSAGE and fields is not None:
                return Request(self._channel, fields)
            if code == _END:
                self.close()
                raise StopAsyncIteration
            await anyio.wait_readable(waker.fileno())

    def close(self) -> None:
        """Release the readiness socket (the iterator then ends)."""
        self._waker = None

    async def aclose(self) -> None:
        """Async :meth:`close`."""
        self.close()
