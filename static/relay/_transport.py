"""The relay's HTTP/2 + gRPC transport: purerpc's framing (``GRPCConnection``, over h2) on
connections we accept ourselves (docs/design.md §7), with a stream layer of our own.

purerpc 0.8.0's ``Server.serve_async`` binds every interface with SO_REUSEPORT and cannot stop
gracefully, and its connection handler ignores RST_STREAM (a cancelled call is noticed only at its
next send, and reset streams keep their state for the connection's life). Its stream layer also
costs several trio scheduling rounds per message (a memory channel per stream whose every send
and receive checkpoints, a writer task woken for every write, response headers in a write of
their own). So the relay keeps purerpc's protocol state machine and replaces the rest:

* events go straight from the connection's reader to the stream's queue, and a waiting handler
  is woken directly (no round trip when the event is already there);
* writes go to the socket at once from the task that produced them (one ``send`` syscall per
  ``flush``, nothing in between), and only what the socket does not take is left to a writer
  task; response headers leave with the first message, and a unary answer (headers, message,
  trailers) in ONE write;
* a reset stream is forgotten at once and its handler told (``on_reset``); a connection that
  resets streams faster than ``reset_rate`` (after a burst) is closed with
  GOAWAY(ENHANCE_YOUR_CALM): the rapid-reset flood;
* a message over the transport limit ends its stream (RESOURCE_EXHAUSTED), not the connection;
* data for a stream we no longer know is dropped (its flow-control credit given back);
* a request's header block that repeats one already decoded, unchanged, is not decoded again,
  nor are repeated answer headers encoded again (:class:`_CachingDecoder`,
  :class:`_CachingEncoder`);
* DATA frames are encoded by hand in the common case, with h2's flow-control accounting
  (:func:`_send_data`), and a connection can be corked so that several answers leave in one
  write (:meth:`RelayConnection.cork`);
* inbound DATA frames are parsed by hand in the common case too, with the same accounting, and
  a frame holding one whole message skips purerpc's read buffer (:meth:`_Connection.receive_data`).
"""

from __future__ import annotations

import collections
import socket
import struct
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import h2.connection
import h2.errors
import h2.events
import h2.stream
import hpack
import trio
from purerpc.grpclib.buffers import MessageReadBuffer
from purerpc.grpclib.connection import GRPCConfiguration, GRPCConnection
from purerpc.grpclib.events import (
    MessageReceived,
    RequestEnded,
    RequestReceived,
    WindowUpdated,
)
from purerpc.grpclib.exceptions import MessageTooLargeError
from purerpc.grpclib.status import Status

__all__ = [
    "MessageTooLarge",
    "RelayConnection",
    "RelayStream",
    "StreamGone",
    "open_connection",
]

_CONNECTION_WINDOW = 64 * 1024 * 1024
_RECEIVE_BYTES = 256 * 1024
#: gRPC's length prefix: a compressed flag (never set here) and the message length.
_PREFIX = struct.Struct(">BI")
#: How long a closing connection keeps trying to hand over what it has queued.
_CLOSE_FLUSH_SECONDS = 1.0
#: An HTTP/2 frame header (RFC 9113 §4.1): 24-bit length (as a byte and a short), type, flags,
#: stream id.
_FRAME_HEADER = struct.Struct(">BHBBI")
_DATA = 0x0
#: Stream states in which h2 sends DATA without changing the state.
_SENDING = frozenset({h2.stream.StreamState.OPEN, h2.stream.StreamState.HALF_CLOSED_REMOTE})
_MESSAGE_LENGTH = struct.Struct(">I")


def _send_data(connection: h2.connection.H2Connection, stream_id: int, data: bytes) -> None:
    """``connection.send_data(stream_id, data)``, in the common case (open connection and
    stream, within the windows and the frame size) without h2's generic path: its state
    machines do not change there, so what remains is its flow-control accounting and the
    frame's bytes (measured: ~2 us a frame against h2's ~14 us, and a message costs the relay
    up to three frames). Anything else goes to h2 (and its errors).
    ``tests/relay/test_send_data.py`` checks it against h2's own."""
    stream = connection.streams.get(stream_id)
    size = len(data)
    if (
        stream is None
        or connection.state_machine.state is not h2.connection.ConnectionState.SERVER_OPEN
        or stream.state_machine.state not in _SENDING
        or size > stream.outbound_flow_control_window
        or size > connection.outbound_flow_control_window
        or size > connection.max_outbound_frame_size
    ):
        connection.send_data(stream_id, data)
        return
    stream.outbound_flow_control_window -= size
    connection.outbound_flow_control_window -= size
    connection._data_to_send += _FRAME_HEADER.pack(size >> 16, size & 0xFFFF, _DATA, 0, stream_id)
    connection._data_to_send += data


class StreamGone(Exception):
    """The stream was reset by the peer, or its connection is gone: nobody is listening."""


class StreamWasReset:
    """The peer reset a stream (RST_STREAM): purerpc drops this event, we do not."""

    def __init__(self, stream_id: int) -> None:
        self.stream_id = stream_id


class MessageTooLarge(MessageReceived):  # type: ignore[misc]
    """A message on the stream exceeded the transport limit; the rest of it is discarded."""

    def __init__(self, stream_id: int, limit: int) -> None:
        super().__init__(stream_id, b"", 0)
        self.limit = limit


#: Every byte of a header block made only of one-byte indexed fields (indexes 1-126).
_INDEXED_BYTES = bytes(range(0x81, 0xFF))
_CACHED_BLOCKS = 32
_CACHED_BLOCK_BYTES = 64


class _CachingDecoder(hpack.Decoder):  # type: ignore[misc]
    """hpack's decoder, remembering the header lists of short blocks made only of one-byte
    indexed fields: what gRPC clients send with every call once their headers are in the
    dynamic table (pure Python, hpack costs ~25 us a block). Decoding such a block reads the
    table and changes nothing, so the same bytes decode the same way until a block that can
    change the table, which empties the memory; the limits are part of the key."""

    def __init__(self, max_header_list_size: int, max_allowed_table_size: int) -> None:
        super().__init__(max_header_list_size=max_header_list_size)
        self.max_allowed_table_size = max_allowed_table_size
        self._decoded: dict[tuple[bytes, int, int, int], list[Any]] = {}

    def decode(self, data: bytes, raw: bool = False) -> list[Any]:
        block = bytes(data)
        if (
            not raw
            or not block
            or len(block) > _CACHED_BLOCK_BYTES
            or block.translate(None, _INDEXED_BYTES)
        ):
            self._decoded.clear()
            result: list[Any] = super().decode(data, raw)
            return result
        key = (
            block,
            self.max_header_list_size,
            self.max_allowed_table_size,
            self.header_table_size,
        )
        headers = self._decoded.get(key)
        if headers is None:
            headers = super().decode(data, raw)
            if len(self._decoded) >= _CACHED_BLOCKS:
                self._decoded.clear()
            self._decoded[key] = headers
        return list(headers)


class _CachingEncoder(hpack.Encoder):  # type: ignore[misc]
    """hpack's encoder, remembering the blocks it encoded as one-byte indexed fields only (the
    response headers and trailers of every call, once they are in the dynamic table): such an
    encoding changed nothing in the table, so the same headers encode the same way until an
    encoding that can change it (a literal, a table resize), which empties the memory."""

    def __init__(self) -> None:
        super().__init__()
        self._encoded: dict[tuple[Any, ...], bytes] = {}

    def encode(self, headers: Any, huffman: bool = True) -> bytes:
        if isinstance(headers, dict) or self.header_table.resized:
            self._encoded.clear()
            block: bytes = super().encode(headers, huffman)
            return block
        headers = list(headers)
        key = (huffman, *((type(h), *h) for h in headers))
        cached = self._encoded.get(key)
        if cached is not None:
            return cached
        block = super().encode(headers, huffman)
        if len(block) > _CACHED_BLOCK_BYTES or block.translate(None, _INDEXED_BYTES):
            self._encoded.clear()
        else:
            if len(self._encoded) >= _CACHED_BLOCKS:
                self._encoded.clear()
            self._encoded[key] = block
        return block


class _Connection(GRPCConnection):  # type: ignore[misc]
    def __init__(self, config: GRPCConfiguration) -> None:
        super().__init__(config=config)
        plain = self.h2_connection.decoder
        self.h2_connection.decoder = _CachingDecoder(
            plain.max_header_list_size, plain.max_allowed_table_size
        )
        self.h2_connection.encoder = _CachingEncoder()
        #: Streams whose oversized message is being dropped.
        self.discarding: set[int] = set()
        #: purerpc's handling of each h2 event (its ``receive_data``, as a table).
        self._dispatch: dict[type, Callable[[Any], list[Any]]] = {
            h2.events.RequestReceived: self._request_received,
            h2.events.ResponseReceived: self._response_received,
            h2.events.TrailersReceived: self._trailers_received,
            h2.events.InformationalResponseReceived: self._informational_response_received,
            h2.events.DataReceived: self._data_received,
            h2.events.WindowUpdated: self._window_updated,
            h2.events.RemoteSettingsChanged: self._remote_settings_changed,
            h2.events.PingAcknowledged: self._ping_acknowledged,
            h2.events.StreamEnded: self._stream_ended,
            h2.events.StreamReset: self._stream_reset,
            h2.events.PushedStreamReceived: self._push_stream_received,
            h2.events.SettingsAcknowledged: self._settings_acknowledged,
            h2.events.PriorityUpdated: self._priority_updated,
            h2.events.ConnectionTerminated: self._connection_terminated,
            h2.events.AlternativeServiceAvailable: self._alternative_service_available,
            h2.events.UnknownFrameReceived: self._unknown_frame_received,
        }

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

    def receive_data(self, data: bytes) -> list[Any]:
        """purerpc's ``receive_data``, with the DATA frames of open streams parsed by hand
        (:meth:`_data_by_hand`) and only the other frames given to h2 (one by one, in order):
        h2 parses a DATA frame in ~25 us of generic code (frame buffer, frame objects, two
        state machines), for what here is a few comparisons and two subtractions. As purerpc
        does, every frame is taken first, then the events (so what h2 and the events queue to
        send is queued in the same order). ``tests/relay/test_receive_data.py`` checks it
        against purerpc's own."""
        h2_connection = self.h2_connection
        incoming = h2_connection.incoming_buffer
        if incoming.data or incoming._preamble_len:
            events: list[Any] = super().receive_data(data)
            return events
        h2_events: list[Any] = []
        end = len(data)
        pos = 0
        while pos + 9 <= end:
            high, low, kind, flags, stream_id = _FRAME_HEADER.unpack_from(data, pos)
            stop = pos + 9 + (high << 16 | low)
            if stop > end:
                break
            if (
                kind == _DATA
                and not flags
                and not incoming._headers_buffer
                and self._data_by_hand(stream_id & 0x7FFFFFFF, stop - pos - 9)
            ):
                event = h2.events.DataReceived()
                event.stream_id = stream_id & 0x7FFFFFFF
                event.data = data[pos + 9 : stop]
                event.flow_controlled_length = stop - pos - 9
                h2_events.append(event)
            else:
                h2_events.extend(h2_connection.receive_data(data[pos:stop]))
            pos = stop
        if pos < end:
            h2_events.extend(h2_connection.receive_data(data[pos:]))
        events = []
        dispatch = self._dispatch
        for event in h2_events:
            handler = dispatch.get(type(event))
            if handler is not None:
                events.extend(handler(event))
        return events

    def _data_by_hand(self, stream_id: int, size: int) -> bool:
        """Take a DATA frame without flags (no padding, no END_STREAM) as h2 does when nothing
        changes state: on an open connection and an open stream without a content-length,
        within the frame size and both windows, all h2 does is its flow-control accounting.
        False (nothing done) for anything else: h2 takes it, and raises its errors."""
        h2_connection = self.h2_connection
        stream = h2_connection.streams.get(stream_id)
        if (
            stream is None
            or h2_connection.state_machine.state is not h2.connection.ConnectionState.SERVER_OPEN
            or stream.state_machine.state is not h2.stream.StreamState.OPEN
            or stream._expected_content_length is not None
            or size > h2_connection.max_inbound_frame_size
        ):
            return False
        connection_window = h2_connection._inbound_flow_control_window_manager
        stream_window = stream._inbound_window_manager
        if size > connection_window.current_window_size or size > stream_window.current_window_size:
            return False
        connection_window.current_window_size -= size
        stream_window.current_window_size -= size
        stream._actual_content_length += size
        return True

    def _data_received(self, event: h2.events.DataReceived) -> list[Any]:
        buffer: MessageReadBuffer | None = self.message_read_buffers.get(event.stream_id)
        data = event.data
        size = len(data)
        if (
            buffer is not None
            and size >= 5
            and event.flow_controlled_length == size
            and buffer._message_length is None
            and not buffer._buffer._size
            and not buffer._messages
            and data[0] == 0
            and _MESSAGE_LENGTH.unpack_from(data, 1)[0] == size - 5
            and size - 5 <= buffer._max_message_length
        ):
            # Exactly one whole uncompressed message, nothing before it: what purerpc's
            # buffer would make of it, without its copies.
            return [MessageReceived(event.stream_id, data[5:], size)]
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


class RelayStream:
    """One server-side call: its request headers, its incoming events, its answers.

    ``receive`` returns MessageReceived (``data``: the raw message bytes), MessageTooLarge or
    RequestEnded; it raises :class:`StreamGone` once the peer reset the stream or the connection
    is gone. Sending never blocks on the socket (the connection queues what it does not take),
    only on HTTP/2 flow control.
    """

    __slots__ = (
        "_connection",
        "_credit",
        "_events",
        "_gone",
        "_ready",
        "consumer",
        "finished",
        "request",
        "started",
        "stream_id",
    )

    def __init__(
        self, connection: RelayConnection, stream_id: int, request: RequestReceived
    ) -> None:
        self._connection = connection
        self.stream_id = stream_id
        self.request = request
        self._events: collections.deque[Any] = collections.deque()
        self._ready = trio.lowlevel.ParkingLot()
        self._credit = trio.lowlevel.ParkingLot()
        self._gone = False
        #: Response headers were sent.
        self.started = False
        #: Trailers were sent: the call is over on our side.
        self.finished = False
        #: Takes events as they arrive, in the reader's task, when it returns True (only while
        #: nothing is queued, so the order holds); the rest is queued for ``receive``.
        self.consumer: Callable[[Any], bool] | None = None

    @property
    def connection(self) -> RelayConnection:
        return self._connection

    # -- from the connection ---------------------------------------------------------------

    def _deliver(self, event: Any) -> None:
        consumer = self.consumer
        if consumer is not None and not self._events and consumer(event):
            if event.flow_controlled_length:
                # Acknowledged as ``receive`` would; the reader flushes after each read.
                self._connection.h2.acknowledge_received_data(
                    event.flow_controlled_length, self.stream_id
                )
            return
        self._events.append(event)
        if self._ready:
            self._ready.unpark()

    def _window_opened(self) -> None:
        if self._credit:
            self._credit.unpark_all()

    def _lost(self) -> None:
        self._gone = True
        self._ready.unpark_all()
        self._credit.unpark_all()

    # -- for the handler -------------------------------------------------------------------

    async def receive(self) -> Any:
        """The next event; no scheduling round when one is already there."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while not self._events:
            if self._gone:
                raise StreamGone
            await self._ready.park()
        event = self._events.popleft()
        if type(event) is MessageReceived and event.flow_controlled_length:
            h2_connection = self._connection.h2
            h2_connection.acknowledge_received_data(event.flow_controlled_length, self.stream_id)
            # h2 only emits a WINDOW_UPDATE once enough is acknowledged: write only then.
            if h2_connection._data_to_send:
                self._connection.flush()
        return event

    def start(self) -> None:
        """Send the response headers now (a streaming-request call: clients may wait for them
        before sending anything) rather than with the first message."""
        if not self.started and not self._gone:
            self._connection.grpc.start_response(self.stream_id, "+proto")
            self.started = True
            self._connection.flush()

    async def send(self, message: bytes, *, flush: bool = True) -> None:
        """Send one (serialized) message, the response headers first if not sent yet."""
        if self._gone or self.finished:
            raise StreamGone
        connection = self._connection
        if not self.started:
            connection.grpc.start_response(self.stream_id, "+proto")
            self.started = True
        data = _PREFIX.pack(0, len(message)) + message
        h2_connection = connection.h2
        while data:
            window = min(
                h2_connection.max_outbound_frame_size,
                h2_connection.local_flow_control_window(self.stream_id),
            )
            if window <= 0:
                # Out of credit: send what is queued, wait for the peer's WINDOW_UPDATE.
                connection.flush()
                connection.credit_waiters.add(self)
                try:
                    await self._credit.park()
                finally:
                    connection.credit_waiters.discard(self)
                if self._gone:
                    raise StreamGone
                continue
            if len(data) <= window:
                _send_data(h2_connection, self.stream_id, data)
                break
            _send_data(h2_connection, self.stream_id, data[:window])
            data = data[window:]
        if flush:
            connection.flush()

    def send_now(self, message: bytes) -> bool:
        """Queue ``message`` (not flushed) if flow control lets it go at once, else send nothing
        and return False (for callers that cannot wait)."""
        if self._gone or self.finished:
            return False
        h2_connection = self._connection.h2
        if len(message) + 5 > h2_connection.local_flow_control_window(self.stream_id):
            return False
        if not self.started:
            self._connection.grpc.start_response(self.stream_id, "+proto")
            self.started = True
        data = _PREFIX.pack(0, len(message)) + message
        frame = h2_connection.max_outbound_frame_size
        for start in range(0, len(data), frame):
            _send_data(h2_connection, self.stream_id, data[start : start + frame])
        return True

    def finish(self, status: Status, trailers: tuple[tuple[str, str], ...] = ()) -> None:
        """End the call with ``status`` (trailers-only when nothing was sent) and flush;
        nothing when the call is already over."""
        if self.finished or self._gone:
            return
        self.finished = True
        grpc = self._connection.grpc
        if self.started:
            grpc.end_response(self.stream_id, status, trailers)
        else:
            grpc.respond_status(self.stream_id, status, "+proto", trailers)
        self._connection.forget(self.stream_id)
        self._connection.flush()


class RelayConnection:
    """One accepted connection: reads it (``serve``), writes to it (``flush``). Opened with
    :func:`open_connection`, which runs the task that writes what the socket did not take."""

    def __init__(
        self,
        config: GRPCConfiguration,
        sock: anyio.abc.SocketStream,
        on_reset: Callable[[int], bool],
    ) -> None:
        self.grpc = _Connection(config=config)
        self.h2 = self.grpc.h2_connection
        self._sock = sock
        self._raw: socket.socket = sock.extra(anyio.abc.SocketAttribute.raw_socket)
        _set_socket_options(self._raw)
        self._on_reset = on_reset
        self._streams: dict[int, RelayStream] = {}
        self.credit_waiters: set[RelayStream] = set()
        #: Bytes the socket has not taken yet (the writer task hands them over).
        self._backlog = bytearray()
        self._broken = False
        self._backlog_waiting = trio.lowlevel.ParkingLot()
        self._room = trio.lowlevel.ParkingLot()
        #: While above 0, ``flush`` leaves everything queued (see :meth:`cork`).
        self._corked = 0

    def _close_streams(self) -> None:
        for stream in list(self._streams.values()):
            stream._lost()
        self._streams.clear()

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    @property
    def backlog(self) -> int:
        """Bytes queued for the socket."""
        return len(self._backlog)

    async def wait_room(self, limit: int) -> None:
        """Wait while more than ``limit`` bytes are queued for the socket."""
        while len(self._backlog) > limit and not self._broken:
            await self._room.park()

    def goaway(self, code: h2.errors.ErrorCodes = h2.errors.ErrorCodes.NO_ERROR) -> None:
        """Tell the peer to open no more streams here."""
        self.h2.close_connection(code)
        self.flush()

    def forget(self, stream_id: int) -> None:
        """Our side of the stream is over: later data for it is acknowledged and dropped."""
        self._streams.pop(stream_id, None)
        self.grpc.message_read_buffers.pop(stream_id, None)

    # -- writing ---------------------------------------------------------------------------

    def cork(self) -> None:
        """Hold back ``flush`` until the matching :meth:`uncork` (synchronous code that writes
        several answers then sends them in one syscall: each costs the relay and the peer a
        wake-up)."""
        self._corked += 1

    def uncork(self) -> None:
        self._corked -= 1
        if not self._corked:
            self.flush()

    def flush(self) -> None:
        """Hand everything h2 has queued to the socket now (unless corked); what it does not
        take waits for the writer task (behind which everything later queues, to keep the
        order)."""
        if self._corked:
            return
        data = self.h2.data_to_send()
        if not data or self._broken:
            return
        if self._backlog:
            self._backlog += data
            return
        try:
            sent = self._raw.send(data)
        except BlockingIOError:
            sent = 0
        except OSError:
            self._break()
            return
        if sent < len(data):
            self._backlog += memoryview(data)[sent:]
            self._backlog_waiting.unpark()

    def _break(self) -> None:
        self._broken = True
        self._backlog.clear()
        self._room.unpark_all()
        for stream in list(self._streams.values()):
            stream._lost()

    async def _write_backlog(self) -> None:
        while True:
            while not self._backlog:
                await self._backlog_waiting.park()
            try:
                await trio.lowlevel.wait_writable(self._raw)
                sent = self._raw.send(self._backlog)
            except BlockingIOError:
                continue
            except OSError:
                self._break()
                return
            del self._backlog[:sent]
            if self._room:
                self._room.unpark_all()

    # -- reading ---------------------------------------------------------------------------

    async def serve(
        self,
        on_stream: Callable[[RelayStream], None],
        after_read: Callable[[], None] | None = None,
        before_read: Callable[[], None] | None = None,
    ) -> None:
        """Read the connection until it ends; ``on_stream`` gets each new call (synchronously:
        it starts the handler); ``after_read`` runs once everything one read brought was
        handed out (the relay starts its group commit there), and ``before_read`` before that
        (``after_read`` is then sure to follow, whatever happens meanwhile). Returns when the
        peer closes, or must go (flood)."""
        while True:
            try:
                data = await self._sock.receive(_RECEIVE_BYTES)
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                return
            events = self.grpc.receive_data(data)
            if before_read is not None:
                before_read()
            try:
                if not self._hand_out(events, on_stream):
                    return
            finally:
                if after_read is not None:
                    after_read()
            # Settings and ping acknowledgements, window updates.
            self.flush()
            if self._broken:
                return

    def _hand_out(self, events: list[Any], on_stream: Callable[[RelayStream], None]) -> bool:
        """Hand one read's events to their streams; False when the connection must go."""
        streams = self._streams
        for event in events:
            kind = type(event)
            if kind is MessageReceived or kind is MessageTooLarge:
                target = streams.get(event.stream_id)
                if target is not None:
                    target._deliver(event)
            elif kind is RequestReceived:
                stream = streams[event.stream_id] = RelayStream(self, event.stream_id, event)
                on_stream(stream)
            elif kind is RequestEnded:
                target = streams.get(event.stream_id)
                if target is not None:
                    target._deliver(event)
            elif kind is WindowUpdated:
                if event.stream_id == 0:
                    for waiter in list(self.credit_waiters):
                        waiter._window_opened()
                else:
                    target = streams.get(event.stream_id)
                    if target is not None:
                        target._window_opened()
            elif kind is StreamWasReset:
                gone = streams.pop(event.stream_id, None)
                if gone is not None:
                    gone._lost()
                if not self._on_reset(event.stream_id):
                    self.flush()
                    return False
        return True


@asynccontextmanager
async def open_connection(
    config: GRPCConfiguration, sock: anyio.abc.SocketStream, on_reset: Callable[[int], bool]
) -> AsyncIterator[RelayConnection]:
    """A :class:`RelayConnection` on ``sock`` (which the caller closes); on a normal exit it
    gets a moment to hand over what is still queued."""
    connection = RelayConnection(config, sock, on_reset)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(connection._write_backlog)
        connection.grpc.initiate_connection()
        connection.flush()
        try:
            yield connection
        except BaseException:
            connection._close_streams()
            nursery.cancel_scope.cancel()
            raise
        connection._close_streams()
        with trio.move_on_after(_CLOSE_FLUSH_SECONDS):
            await connection.wait_room(0)
        nursery.cancel_scope.cancel()


def _set_socket_options(sock: socket.socket) -> None:
    """As purerpc sets them: no Nagle delay (answers are small and latency matters), TCP
    keep-alive to notice vanished peers."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 300)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 30)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 5)
