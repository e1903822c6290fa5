"""The relay's hand-encoded DATA frames (``_send_data``) against h2's own ``send_data``: the same
bytes, the same flow-control windows, the same errors, whatever the stream's state."""

from __future__ import annotations

import random

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import pytest
from purerpc.grpclib.connection import GRPCConfiguration

from static.relay._transport import _Connection, _send_data

_HEADERS = [(":method", "POST"), (":path", "/x"), (":scheme", "http"), (":authority", "a")]


def _pair(
    max_frame: int = 16384, window: int = 65535, connection_window: int = 65535
) -> tuple[h2.connection.H2Connection, h2.connection.H2Connection]:
    """A relay-side connection with streams 1, 3 and 5 open, and its client."""
    server = _Connection(GRPCConfiguration(client_side=False)).h2_connection
    server.initiate_connection()
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    client.update_settings({h2.settings.SettingCodes.MAX_FRAME_SIZE: max_frame})
    client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
    if connection_window > 65535:
        client.increment_flow_control_window(connection_window - 65535)
    for stream_id in (1, 3, 5):
        client.send_headers(stream_id, _HEADERS)
    client.end_stream(3)  # half-closed (remote) on the relay's side
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    server.receive_data(client.data_to_send())
    server.data_to_send()
    return server, client


def _state(connection: h2.connection.H2Connection) -> tuple[object, ...]:
    return (
        connection.outbound_flow_control_window,
        connection.state_machine.state,
        tuple(
            (sid, s.outbound_flow_control_window, s.state_machine.state)
            for sid, s in sorted(connection.streams.items())
        ),
    )


def test_the_same_bytes_and_windows_as_h2() -> None:
    rng = random.Random(5)
    plain, client = _pair(max_frame=20000, window=10**6, connection_window=10**8)
    fast, _ = _pair(max_frame=20000, window=10**6, connection_window=10**8)
    fast_frames = 0
    for _ in range(500):
        stream_id = rng.choice([1, 3, 5])
        data = rng.randbytes(rng.choice([0, 1, 5, 300, 1029, 16384, 20000]))
        plain.send_data(stream_id, data)
        _send_data(fast, stream_id, data)
        expected = plain.data_to_send()
        assert fast.data_to_send() == expected
        assert _state(fast) == _state(plain)
        fast_frames += 1
        # The peer reads it as the data it is.
        events = client.receive_data(expected)
        received = [e for e in events if isinstance(e, h2.events.DataReceived)]
        assert [(e.stream_id, e.data) for e in received] == [(stream_id, data)]
        if received[0].flow_controlled_length:
            client.acknowledge_received_data(received[0].flow_controlled_length, stream_id)
    assert fast_frames == 500


@pytest.mark.parametrize(
    ("stream_id", "size", "prepare"),
    [
        (1, 70000, None),  # over the stream's window
        (1, 17000, None),  # over the frame size
        (7, 10, None),  # a stream that was never opened
        (1, 10, "end"),  # our side of the stream ended
        (5, 10, "reset"),  # the stream was reset
        (1, 10, "goaway"),  # the connection is closing
    ],
)
def test_what_h2_refuses_is_refused_alike(stream_id: int, size: int, prepare: str | None) -> None:
    outcomes = []
    for send in (h2.connection.H2Connection.send_data, _send_data):
        server, _ = _pair()
        if prepare == "end":
            server.end_stream(1)
        elif prepare == "reset":
            server.reset_stream(5)
        elif prepare == "goaway":
            server.close_connection()
        server.data_to_send()
        with pytest.raises(h2.exceptions.H2Error) as caught:
            send(server, stream_id, b"x" * size)
        outcomes.append((type(caught.value), _state(server), server.data_to_send()))
    assert outcomes[0] == outcomes[1]


def test_the_connection_window_bounds_it_too() -> None:
    outcomes = []
    for send in (h2.connection.H2Connection.send_data, _send_data):
        server, _ = _pair(window=10**6)
        for _ in range(3):
            send(server, 1, b"x" * 16384)
        send(server, 5, b"x" * 16382)
        # 65,535 - 3 x 16,384 - 16,382 = 1 byte of connection window left.
        with pytest.raises(h2.exceptions.FlowControlError):
            send(server, 5, b"xy")
        send(server, 5, b"x")
        outcomes.append((_state(server), server.data_to_send()))
    assert outcomes[0] == outcomes[1]
