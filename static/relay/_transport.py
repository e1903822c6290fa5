"""purerpc's HTTP/2 + gRPC framing on connections we accept ourselves (DESIGN §7).

purerpc 0.8.0's ``Server.serve_async`` binds every interface with SO_REUSEPORT and cannot stop
gracefully, and its connection handler ignores RST_STREAM (a cancelled call is noticed only at its
next send, and reset streams keep their state for the connection's life). So the relay accepts
connections on a listener of its own and runs purerpc's socket with these fixes:

* a reset stream is forgotten at once and its handler cancelled (``on_reset``);
* a connection that resets streams faster than ``reset_rate`` (after a burst) is closed with
  GOAWAY(ENHANCE_YOUR_CALM): the rapid-reset flood;
* a message over the transport limit ends its stream (RESOURCE_EXHAUSTED), not the connection;
* data for a stream purerpc no longer knows is dropped instead of raising ``KeyError``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from typing import Any

import anyio
import h2.errors
import h2.events
from purerpc.grpc_proto import GRPCProtoSocket, GRPCProtoStream
from purerpc.grpc_socket import GRPCStreamState, SocketWrapper
from purerpc.grpclib.buffers import MessageReadBuffer
from purerpc.grpclib.connection import GRPCConfiguration, GRPCConnection
from purerpc.grpclib.events import (
    MessageReceived,
    RequestEnded,
    RequestReceived,
    WindowUpdated,
)
from purerpc.grpclib.exceptions import MessageTooLargeError

__all__ = ["MessageTooLarge", "RelaySocket", "StreamWasReset"]

_CONNECTION_WINDOW = 64 * 1024 * 1024


class StreamWasReset:
    """The peer reset a stream (RST_STREAM): purerpc drops this event, we do not."""

    def __init__(self, stream_id: int) -> None:
        self.stream_id = stream_id


class MessageTooLarge(MessageReceived):  # type: ignore[misc]
    """A message on the stream exceeded the transport limit; the rest of it is discarded.

    A (empty) MessageReceived so that purerpc's stream hands it to the handler as it is.
    """

    def __init__(self, stream_id: int, limit: int) -> None:
        super().__init__(stream_id, b"", 0)
        self.limit = limit


class _Connection(GRPCConnection):  # type: ignore[misc]
    def __init__(self, config: GRPCConfiguration) -> None:
        super().__init__(config=config)
        #: Streams whose oversized message is being dropped.
        self.discarding: set[int] = set()

    def initiate_connection(self) -> None:
        # purerpc opens the connection-level window to 1 GiB; bound what a peer may have in
        # flight on one connection (each stream's own window still fits a whole message).
        self.h2_connection.initiate_connection()
        self.h2_connection.increment_flow_control_window(_CONNECTION_WINDOW - 65535)

    def _stream_reset(self, event: h2.events.StreamReset) -> list[Any]:
        self.message_read_buffers.pop(event.stream_id, None)
        self.discarding.discard(event.stream_id)
        return [StreamWasReset(event.stream_id)]

    def _stream_ended(self, event: h2.events.StreamEnded) -> list[Any]:
        if event.stream_id in self.discarding:
            self.discarding.discard(event.stream_id)
            return [RequestEnded(event.stream_id)]
        result: list[Any] = super()._stream_ended(event)
        return result

    def _data_received(self, event: h2.events.DataReceived) -> list[Any]:
        buffer: MessageReadBuffer | None = self.message_read_buffers.get(event.stream_id)
        if buffer is None:
            # A stream we gave up on: give the flow-control credit back, drop the bytes.
            if event.flow_controlled_length:
                self.h2_connection.acknowledge_received_data(
                    event.flow_controlled_length, event.stream_id
                )
            return []
        try:
            buffer.data_received(event.data, event.flow_controlled_length)
            return [
                MessageReceived(event.stream_id, message, length)
                for message, length in buffer.read_all_complete_messages_flowcontrol()
            ]
        except MessageTooLargeError:
            del self.message_read_buffers[event.stream_id]
            self.discarding.add(event.stream_id)
            if event.flow_controlled_length:
                self.h2_connection.acknowledge_received_data(
                    event.flow_controlled_length, event.stream_id
                )
            return [MessageTooLarge(event.stream_id, self.config.max_message_length)]


class RelaySocket(GRPCProtoSocket):  # type: ignore[misc]
    """A server-side purerpc socket with the fixes above."""

    def __init__(
        self,
        config: GRPCConfiguration,
        sock: anyio.abc.SocketStream,
        on_reset: Callable[[int], bool],
    ) -> None:
        AsyncExitStack.__init__(self)
        self._grpc_connection = _Connection(config=config)
        self._socket = SocketWrapper(self._grpc_connection, sock)
        self._receive_buffer_size = 64 * 1024
        self._streams: dict[int, GRPCProtoStream] = {}
        self._on_reset = on_reset

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    async def goaway(self, code: h2.errors.ErrorCodes = h2.errors.ErrorCodes.NO_ERROR) -> None:
        """Tell the peer to open no more streams here."""
        self._grpc_connection.h2_connection.close_connection(code)
        await self._socket.flush()

    async def _listen(self) -> AsyncIterator[GRPCProtoStream]:
        while True:
            try:
                data = await self._socket.recv(self._receive_buffer_size)
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                return
            events = self._grpc_connection.receive_data(data)
            await self._socket.flush()
            for event in events:
                if isinstance(event, WindowUpdated):
                    targets = (
                        list(self._streams.values())
                        if event.stream_id == 0
                        else [s for s in [self._streams.get(event.stream_id)] if s is not None]
                    )
                    for target in targets:
                        await target._set_flow_control_update()
                elif isinstance(event, RequestReceived):
                    stream = self._allocate_stream(event.stream_id)
                    await stream._incoming_events[0].send(event)
                    yield stream
                elif isinstance(event, StreamWasReset):
                    gone = self._streams.pop(event.stream_id, None)
                    if gone is not None:
                        gone._state = GRPCStreamState.CLOSED
                    if not self._on_reset(event.stream_id):
                        return
                else:
                    target = self._streams.get(event.stream_id)
                    if target is None:
                        continue
                    await target._incoming_events[0].send(event)
                    if isinstance(event, RequestEnded):
                        target._close_remote()
