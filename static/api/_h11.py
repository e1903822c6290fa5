"""HTTP/1.1 edges hypercorn's h11 protocol leaves open: request smuggling, oversized heads, empty
error bodies, and closing on a client that is still sending (docs/design.md §7, "HTTP/1.1 edges").

:class:`StaticH11Protocol` subclasses hypercorn's ``H11Protocol`` (0.18.0) and changes four
things, each as an upstream fix would (no file of site-packages is touched):

- A request with both ``Content-Length`` and ``Transfer-Encoding`` is refused with 400 and the
  connection closed (RFC 9112 §6.3: such a message "ought to be handled as an error" and the
  server "MUST close the connection after responding"). h11 (0.16) lets Transfer-Encoding win
  and keeps the connection, so a front end that believed Content-Length sees the chunked body's
  tail as a second request (measured at e879e1d: two responses, connection open).
- A request head over ``h11_max_incomplete_size`` (16 KiB) is refused with 431 and the connection
  closed, however it arrived. h11 bounds only a head it is still waiting for (the buffer of an
  incomplete event): a head that arrived complete in one read (hypercorn reads up to 64 KiB), or
  whose last read completed it, was parsed whatever its size (measured: a 40,000-byte header
  got 200).
- The responses hypercorn writes itself (400 for what h11 cannot parse, 431 for oversized
  headers, 501 for a transfer coding other than chunked) carry ``{"error": text}`` like the
  app's, instead of an empty body.
- Lingering close: when a response is complete but the request body is not (a 413, or any
  answer given before the body was read), the rest of the body is read and dropped before the
  connection closes, bounded by time as nginx's ``lingering_time`` and ``lingering_timeout``
  are: :data:`LINGER_SECONDS` in all, :data:`LINGER_IDLE_SECONDS` without data, and
  :data:`LINGER_BYTES`. Closing with unread data makes the kernel send a reset, which a client
  that writes its whole body before reading (Python's urllib) gets as a broken pipe instead of
  the 413.
"""

from __future__ import annotations

import json
from typing import Any

import h11
import hypercorn.protocol
import trio
from hypercorn.events import Closed, Event, RawData
from hypercorn.protocol.h11 import H11Protocol

__all__ = [
    "LINGER_BYTES",
    "LINGER_IDLE_SECONDS",
    "LINGER_SECONDS",
    "StaticH11Protocol",
    "install",
]

#: Bounds of a lingering close. Time is the bound that matters (nginx's ``lingering_time``, 30 s,
#: and ``lingering_timeout``, 5 s): a client's whole over-limit body arrives within it unless the
#: client is very slow (10 s is 12 MiB at 10 Mbit/s; urllib's 8 MiB took 0.06 s over loopback),
#: and a peer that sends forever, or pauses, is cut off. The byte cap is far above the routes'
#: limits (64 KiB), so a well-meaning client never meets it: it caps what a fast hostile peer
#: makes the server read per answer (64 MiB: 0.24 s of the server's CPU, measured over loopback).
LINGER_SECONDS = 10.0
LINGER_IDLE_SECONDS = 2.0
LINGER_BYTES = 64 << 20

#: The ``error`` text of each status hypercorn or h11 answers by themselves.
_TEXTS = {
    400: "malformed http request",
    431: "request header fields too large",
    501: "transfer coding not supported",
}
_CL_AND_TE = "request has both content-length and transfer-encoding"


class _StrictConnection(h11.Connection):
    """h11's server connection, refusing a request that declares both body lengths or whose head
    is over ``max_head`` bytes."""

    refusal: str | None = None

    def __init__(self, role: type[h11.SERVER], max_head: int) -> None:
        super().__init__(role, max_incomplete_event_size=max_head)
        self.max_head = max_head

    def next_event(self) -> Any:
        if self.refusal is not None:
            raise h11.RemoteProtocolError(self.refusal)
        # The head's size is what parsing it took from the buffer. The public trailing_data
        # copies the buffer; only done while a head is awaited, on at most one read's bytes.
        before = len(self.trailing_data[0]) if self.their_state is h11.IDLE else 0
        event = super().next_event()
        if isinstance(event, h11.Request):
            if before - len(self.trailing_data[0]) > self.max_head:
                self.refusal = _TEXTS[431]
                raise h11.RemoteProtocolError(self.refusal, error_status_hint=431)
            names = {name for name, _ in event.headers}
            if b"content-length" in names and b"transfer-encoding" in names:
                self.refusal = _CL_AND_TE
                raise h11.RemoteProtocolError(self.refusal, error_status_hint=400)
        return event


class StaticH11Protocol(H11Protocol):
    """hypercorn's HTTP/1.1 protocol with the fixes of this module."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.connection = _StrictConnection(h11.SERVER, self.config.h11_max_incomplete_size)
        # Set while lingering; set() once the connection is being closed.
        self._lingering: trio.Event | None = None
        self._drained = 0
        # The bound on a pause while lingering, pushed back by each read.
        self._idle: trio.CancelScope | None = None

    async def handle(self, event: Event) -> None:
        if self._lingering is None:
            await super().handle(event)
        elif isinstance(event, RawData):
            await self._drain(event.data)
        else:
            self._lingering.set()
            await super().handle(event)

    async def _send_error_response(self, status_code: int) -> None:
        text = _TEXTS.get(status_code, "bad request")
        if isinstance(self.connection, _StrictConnection) and self.connection.refusal:
            text = self.connection.refusal
        body = json.dumps({"error": text}).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
            *self.config.response_headers("h11"),
        ]
        await self._send_h11_event(h11.Response(status_code=status_code, headers=headers))
        await self._send_h11_event(h11.Data(data=body))
        await self._send_h11_event(h11.EndOfMessage())

    async def _maybe_recycle(self) -> None:
        connection = self.connection
        if (
            isinstance(connection, h11.Connection)
            and connection.their_state is h11.SEND_BODY
            and connection.our_state in (h11.DONE, h11.MUST_CLOSE)
        ):
            # Answered, but the body is still coming: hypercorn would close now.
            await self._close_stream()
            await self.can_read.set()
            self._lingering = trio.Event()
            self.task_group.spawn(self._linger_deadline, self._lingering)
            await self._drain_buffered()
        else:
            await super()._maybe_recycle()

    async def _drain(self, data: bytes) -> None:
        self._drained += len(data)
        if not data or self._drained > LINGER_BYTES:
            await self._stop_lingering()
            return
        if self._idle is not None:
            self._idle.deadline = trio.current_time() + LINGER_IDLE_SECONDS
        self.connection.receive_data(data)
        await self._drain_buffered()

    async def _drain_buffered(self) -> None:
        """Drop the body h11 has; close once it ends (or goes wrong)."""
        while self._lingering is not None and not self._lingering.is_set():
            try:
                event = self.connection.next_event()
            except h11.RemoteProtocolError:
                await self._stop_lingering()
                return
            if event is h11.NEED_DATA:
                return
            if not isinstance(event, h11.Data):
                await self._stop_lingering()

    async def _linger_deadline(self, lingering: trio.Event) -> None:
        with trio.move_on_after(LINGER_SECONDS):
            with trio.CancelScope(deadline=trio.current_time() + LINGER_IDLE_SECONDS) as idle:
                self._idle = idle
                await lingering.wait()
        self._idle = None
        await self._stop_lingering()

    async def _stop_lingering(self) -> None:
        if self._lingering is None or self._lingering.is_set():
            return
        self._lingering.set()
        await self.send(Closed())


def install() -> None:
    """Make hypercorn serve HTTP/1.1 with :class:`StaticH11Protocol` (idempotent).

    ``ProtocolWrapper`` picks the class by its module-level name; there is no configuration
    hook for it in hypercorn 0.18.0.
    """
    hypercorn.protocol.H11Protocol = StaticH11Protocol  # type: ignore[attr-defined]
