"""A bare HTTP/2 client (the h2 library) for what a well-behaved gRPC client never does: stop
reading, vanish without a reset, flood resets."""

from __future__ import annotations

import socket
import struct
import time
from typing import Any

import h2.config
import h2.connection
import h2.events

from tests.relay.client import pb

__all__ = ["RawH2"]


class RawH2:
    def __init__(self, relay_url: str, *, validate_headers: bool = True) -> None:
        host, _, port = relay_url.removeprefix("grpc://").rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.conn = h2.connection.H2Connection(
            h2.config.H2Configuration(
                client_side=True,
                validate_outbound_headers=validate_headers,
                normalize_outbound_headers=validate_headers,
            )
        )
        self.conn.initiate_connection()
        self.flush()
        self.buffers: dict[int, bytearray] = {}
        self.ended: dict[int, Any] = {}
        self.goaway: h2.events.ConnectionTerminated | None = None

    def flush(self) -> None:
        self.sock.sendall(self.conn.data_to_send())

    def start(
        self,
        method: str,
        request: Any,
        *,
        end: bool = True,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> int:
        stream_id: int = self.conn.get_next_available_stream_id()
        self.conn.send_headers(
            stream_id,
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", f"/static.relay.v1.Relay/{method}"),
                (":authority", "relay"),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
                *metadata,
            ],
        )
        body = request.SerializeToString()
        self.conn.send_data(stream_id, struct.pack(">?I", False, len(body)) + body, end_stream=end)
        self.flush()
        self.buffers[stream_id] = bytearray()
        return stream_id

    def pump(self, seconds: float, *, ack: bool = True) -> bool:
        """Read for up to ``seconds``; False once the server closed the connection."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                return True
            except OSError:
                return False
            if not data:
                return False
            for event in self.conn.receive_data(data):
                if isinstance(event, h2.events.DataReceived):
                    self.buffers.setdefault(event.stream_id, bytearray()).extend(event.data)
                    if ack:
                        self.conn.acknowledge_received_data(
                            event.flow_controlled_length, event.stream_id
                        )
                elif isinstance(event, h2.events.TrailersReceived | h2.events.StreamReset):
                    self.ended[event.stream_id] = event
                elif isinstance(event, h2.events.ResponseReceived) and event.stream_ended:
                    self.ended[event.stream_id] = event  # a trailers-only response
                elif isinstance(event, h2.events.ConnectionTerminated):
                    self.goaway = event
            try:
                self.flush()
            except OSError:
                return False
        return True

    def entries(self, stream_id: int) -> list[Any]:
        """The Subscribe entries received so far on ``stream_id`` (keep-alives skipped)."""
        data, out, pos = bytes(self.buffers.get(stream_id, b"")), [], 0
        while pos + 5 <= len(data):
            (length,) = struct.unpack(">I", data[pos + 1 : pos + 5])
            if pos + 5 + length > len(data):
                break
            response = pb.SubscribeResponse.FromString(data[pos + 5 : pos + 5 + length])
            if response.HasField("entry"):
                out.append(response.entry)
            pos += 5 + length
        return out

    def close(self) -> None:
        self.sock.close()
