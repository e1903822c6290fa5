"""The relay's hand-parsed inbound DATA frames (``_Connection.receive_data``) against purerpc's
own ``receive_data`` (h2's parser): the same events, the same flow-control windows and stream
states, the same WINDOW_UPDATEs once the same data is acknowledged, the same errors, over random
traffic cut at random places."""

from __future__ import annotations

import random
import struct
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import hyperframe.frame  # type: ignore[import-untyped]
import pytest
from purerpc.grpclib.connection import GRPCConfiguration, GRPCConnection
from purerpc.grpclib.events import MessageReceived

from static.relay._transport import _Connection

_MAX_MESSAGE = 3000


def _headers(stream_id: int) -> list[tuple[str, str]]:
    return [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/static.relay.v1.Relay/PublishBatches"),
        (":authority", "relay"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        ("x-call", str(stream_id)),
    ]


class _Counted(_Connection):
    """Counts the DATA frames its h2 connection parses itself."""

    def __init__(self, config: GRPCConfiguration) -> None:
        super().__init__(config)
        self.h2_data_frames = 0
        table = self.h2_connection._frame_dispatch_table
        parse = table[hyperframe.frame.DataFrame]

        def counted(frame: Any) -> Any:
            self.h2_data_frames += 1
            return parse(frame)

        table[hyperframe.frame.DataFrame] = counted


def _servers(client: h2.connection.H2Connection) -> tuple[_Counted, _Connection]:
    """The hand-parsing connection and one reading with purerpc's own ``receive_data``, their
    settings given to ``client``."""
    config = GRPCConfiguration(client_side=False, max_message_length=_MAX_MESSAGE)
    fast, plain = _Counted(config), _Connection(config)
    for server in (fast, plain):
        server.initiate_connection()
    sent = fast.h2_connection.data_to_send()
    assert plain.h2_connection.data_to_send() == sent
    client.receive_data(sent)
    return fast, plain


def _plain_receive(server: _Connection, data: bytes) -> list[Any]:
    events: list[Any] = GRPCConnection.receive_data(server, data)
    return events


def _event(event: Any) -> tuple[object, ...]:
    attributes = sorted((k, repr(v)) for k, v in vars(event).items())
    return (type(event).__name__, *attributes)


def _state(server: _Connection, failed: bool = False) -> tuple[object, ...]:
    connection = server.h2_connection
    return (
        connection.state_machine.state,
        connection._inbound_flow_control_window_manager.current_window_size,
        connection.outbound_flow_control_window,
        tuple(
            (
                stream_id,
                stream.state_machine.state,
                stream._inbound_window_manager.current_window_size,
                stream._actual_content_length,
            )
            for stream_id, stream in sorted(connection.streams.items())
        ),
        # After a connection error h2 leaves the rest of the read in its buffer, unread
        # (the connection is over, and the relay drops it): only the error matters then.
        b"" if failed else bytes(connection.incoming_buffer.data),
        len(connection.incoming_buffer._headers_buffer),
        tuple(sorted(server.message_read_buffers)),
        tuple(sorted(server.discarding)),
    )


def _acknowledge(server: _Connection, events: list[Any]) -> None:
    for event in events:
        if type(event) is MessageReceived and event.flow_controlled_length:
            server.h2_connection.acknowledge_received_data(
                event.flow_controlled_length, event.stream_id
            )


def _run(fast: _Counted, plain: _Connection, data: bytes) -> bytes:
    """Feed ``data`` to both and check them; acknowledge their messages alike; what they
    send back."""
    got: list[tuple[str, Any]] = []
    for server, receive in ((fast, _Connection.receive_data), (plain, _plain_receive)):
        try:
            got.append(("events", receive(server, data)))
        except Exception as exc:  # noqa: BLE001  (the errors are compared)
            got.append(("error", (type(exc).__name__, str(exc))))
    (fast_kind, fast_out), (plain_kind, plain_out) = got
    assert fast_kind == plain_kind
    if fast_kind == "error":
        assert fast_out == plain_out
    else:
        assert [_event(e) for e in fast_out] == [_event(e) for e in plain_out]
        _acknowledge(fast, fast_out)
        _acknowledge(plain, plain_out)
    failed = fast_kind == "error"
    assert _state(fast, failed) == _state(plain, failed)
    sent = fast.h2_connection.data_to_send()
    assert plain.h2_connection.data_to_send() == sent
    return bytes(sent)


def _message(rng: random.Random) -> bytes:
    size = rng.choice([0, 1, 20, 300, 1100, 2999, 3000, 3001, 5000])
    return struct.pack(">?I", False, size) + rng.randbytes(size)


@pytest.mark.parametrize("seed", range(6))
def test_the_same_events_windows_and_window_updates_as_purerpc(seed: int) -> None:
    rng = random.Random(seed)
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    fast, plain = _servers(client)
    client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 10**6})
    open_streams: list[int] = []
    pending = b""
    data_frames = 0
    for _ in range(400):
        action = rng.random()
        if action < 0.1 or not open_streams:
            stream_id = client.get_next_available_stream_id()
            client.send_headers(stream_id, _headers(stream_id))
            open_streams.append(stream_id)
        elif action < 0.75:
            stream_id = rng.choice(open_streams)
            stream = _message(rng)
            # One message a frame (the common case), or cut anywhere, or several a frame.
            cut = rng.choice(["whole", "whole", "split", "joined"])
            if cut == "joined":
                stream += _message(rng)
            pieces = [stream]
            if cut == "split" and len(stream) > 1:
                at = rng.randrange(1, len(stream))
                pieces = [stream[:at], stream[at:]]
            for piece in pieces:
                window = client.local_flow_control_window(stream_id)
                if len(piece) > min(window, client.max_outbound_frame_size):
                    break
                padding = rng.choice([0, 0, 0, 0, 3])
                if padding and len(piece) + padding + 1 > client.max_outbound_frame_size:
                    padding = 0
                client.send_data(stream_id, piece, pad_length=padding or None)
                data_frames += 1
        elif action < 0.8:
            stream_id = open_streams.pop(rng.randrange(len(open_streams)))
            client.end_stream(stream_id)
        elif action < 0.85:
            stream_id = open_streams.pop(rng.randrange(len(open_streams)))
            client.reset_stream(stream_id)
        elif action < 0.9:
            client.ping(rng.randbytes(8))
        else:
            client.increment_flow_control_window(rng.randrange(1, 5000))
        pending += client.data_to_send()
        # Reads cut at random places: whole frames, partial frames, several frames.
        while pending and rng.random() < 0.7:
            take = rng.choice([len(pending), rng.randrange(1, len(pending) + 1)])
            # The servers' WINDOW_UPDATEs and ping answers (the same) reach the client.
            for event in client.receive_data(_run(fast, plain, pending[:take])):
                assert not isinstance(event, h2.events.ConnectionTerminated)
            pending = pending[take:]
    if pending:
        _run(fast, plain, pending)
    # Many DATA frames were taken by hand; h2 parsed the others (padded, ending a stream, in
    # a read that follows a cut frame).
    assert data_frames > 100
    assert fast.h2_data_frames < data_frames * 0.8


def _frame(stream_id: int, payload: bytes, flags: int = 0) -> bytes:
    size = len(payload)
    return struct.pack(">BHBBI", size >> 16, size & 0xFFFF, 0, flags, stream_id) + payload


def _opened(streams: int = 1) -> tuple[_Counted, _Connection, h2.connection.H2Connection]:
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    fast, plain = _servers(client)
    for stream_id in range(1, 2 * streams, 2):
        client.send_headers(stream_id, _headers(stream_id))
    _run(fast, plain, client.data_to_send())
    return fast, plain, client


@pytest.mark.parametrize(
    "case",
    [
        "over the stream window",
        "over the frame size",
        "unknown stream",
        "stream zero",
        "after the client's end of stream",
        "after a reset",
        "too large a message",
        "compressed flag",
        "content-length",
    ],
)
def test_what_h2_does_with_unusual_data_is_done_alike(case: str) -> None:
    fast, plain, client = _opened(streams=2)
    message = struct.pack(">?I", False, 10) + b"0123456789"
    if case == "over the stream window":
        frames = b"".join(
            _frame(1, struct.pack(">?I", False, 16000) + bytes(16000)) for _ in range(5)
        )
    elif case == "over the frame size":
        frames = _frame(1, struct.pack(">?I", False, 17000) + bytes(17000))
    elif case == "unknown stream":
        frames = _frame(9, message)
    elif case == "stream zero":
        frames = _frame(0, message)
    elif case == "after the client's end of stream":
        client.end_stream(1)
        frames = client.data_to_send() + _frame(1, message)
    elif case == "after a reset":
        client.reset_stream(3)
        frames = client.data_to_send() + _frame(3, message) + _frame(1, message)
    elif case == "too large a message":
        big = struct.pack(">?I", False, _MAX_MESSAGE + 1) + bytes(_MAX_MESSAGE + 1)
        frames = _frame(1, big) + _frame(1, message)
    elif case == "compressed flag":
        frames = _frame(1, struct.pack(">?I", True, 10) + b"0123456789")
    else:
        client.send_headers(5, [*_headers(5), ("content-length", "15")])
        frames = client.data_to_send() + _frame(5, message)
    _run(fast, plain, frames)
    if fast.h2_connection.state_machine.state is not h2.connection.ConnectionState.CLOSED:
        _run(fast, plain, _frame(1, message))  # and the connection goes on alike


def test_a_read_of_whole_single_message_frames_skips_h2() -> None:
    fast, plain, _ = _opened(streams=2)
    message = struct.pack(">?I", False, 10) + b"0123456789"
    _run(fast, plain, _frame(1, message) + _frame(3, message) + _frame(1, message))
    assert fast.h2_data_frames == 0
