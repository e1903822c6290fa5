"""``serve_purerpc_relay``: the relay in Python (purerpc), used on PostgreSQL: its listener,
connections and background tasks, until shutdown."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import cast

import anyio
import anyio.abc
import h2.errors
import trio
from h2.exceptions import H2Error
from purerpc.grpclib.connection import GRPCConfiguration

from static._settings import Address, ServerSettings
from static.auth import TokenVerifier
from static.relay._auth import Authenticator
from static.relay._errors import ResourceExhausted
from static.relay._log import ChannelLog
from static.relay._rules import TokenBucket
from static.relay._service import Early, RelayService
from static.relay._transport import RelayConnection, RelayStream, open_connection
from static.store import Database
from static.store._channels import ChannelStore

__all__ = ["serve_purerpc_relay"]

_log = logging.getLogger("static.relay")


@dataclass(eq=False, slots=True)
class _Connection:
    peer: str
    resets: TokenBucket
    handlers: dict[int, trio.CancelScope] = field(default_factory=dict)
    socket: RelayConnection | None = None
    flooded: bool = False
    #: Cancelled to stop reading new streams; leaving the socket then flushes what is queued.
    listening: trio.CancelScope = field(default_factory=trio.CancelScope)

    def on_reset(self, stream_id: int) -> bool:
        """A stream was reset: cancel its handler; False when the connection must close."""
        scope = self.handlers.pop(stream_id, None)
        if scope is not None:
            scope.cancel()
        if self.resets.take(time.monotonic()) > 0:
            self.flooded = True
            return False
        return True


class _Relay:
    def __init__(self, service: RelayService, settings: ServerSettings) -> None:
        relay = settings.relay_settings
        self._service = service
        self._settings = relay
        # Room for a message and a welcome at the limit, plus the request's own fields.
        self._config = GRPCConfiguration(
            client_side=False, max_message_length=2 * relay.max_message_bytes + 64 * 1024
        )
        self.connections: set[_Connection] = set()

    async def accept(self, listener: anyio.abc.SocketListener, nursery: trio.Nursery) -> None:
        while True:
            try:
                sock = await listener.accept()
            except OSError as exc:  # e.g. out of file descriptors: wait, then go on
                _log.warning("relay: accept failed: %s", exc)
                await trio.sleep(0.1)
                continue
            nursery.start_soon(self.connection, sock)

    async def connection(self, sock: anyio.abc.SocketStream) -> None:
        relay = self._settings
        try:
            address = sock.extra(anyio.abc.SocketAttribute.remote_address)
            peer = f"{address[0]}:{address[1]}" if isinstance(address, tuple) else str(address)
        except (OSError, TypeError, ValueError):
            peer = "unknown"
        conn = _Connection(
            peer,
            TokenBucket.full(relay.reset_rate_per_second, relay.reset_burst, time.monotonic()),
        )
        self.connections.add(conn)
        try:
            async with open_connection(self._config, sock, conn.on_reset) as grpc_socket:
                conn.socket = grpc_socket
                async with trio.open_nursery() as streams:

                    def on_stream(stream: RelayStream) -> None:
                        if len(conn.handlers) >= relay.max_streams_per_connection:
                            self._service.refuse(
                                stream,
                                ResourceExhausted(
                                    "too many concurrent streams on this connection (limit "
                                    f"{relay.max_streams_per_connection})"
                                ),
                            )
                            return
                        scope = trio.CancelScope()
                        conn.handlers[stream.stream_id] = scope
                        early = self._service.prepare(stream, conn.peer)
                        streams.start_soon(self._stream, conn, stream, scope, early)

                    with conn.listening:
                        await grpc_socket.serve(
                            on_stream, self._service.commit_pending, self._service.reading
                        )
                    if conn.flooded:
                        _log.warning("relay: closing %s: too many stream resets", peer)
                        grpc_socket.goaway(h2.errors.ErrorCodes.ENHANCE_YOUR_CALM)
                    # The peer closed the connection (or must go): its streams end with it.
                    streams.cancel_scope.cancel()
        except Exception as exc:  # noqa: BLE001  (a broken peer ends its connection, nothing more)
            _log.debug("relay: connection %s ended: %r", peer, exc)
        finally:
            self.connections.discard(conn)
            await anyio.aclose_forcefully(sock)

    async def _stream(
        self,
        conn: _Connection,
        stream: RelayStream,
        scope: trio.CancelScope,
        early: Early | None,
    ) -> None:
        try:
            with scope:
                await self._service.handle(stream, conn.peer, early)
        finally:
            conn.handlers.pop(stream.stream_id, None)
            stream.connection.forget(stream.stream_id)

    async def drain(self, seconds: float) -> None:
        """Shutdown: end subscriptions, wait for in-flight calls, then GOAWAY and close.

        (h2 refuses to send anything after its GOAWAY, so that comes last.)
        """
        self._service.drain()
        with trio.move_on_after(seconds):
            while any(conn.handlers for conn in self.connections):  # noqa: ASYNC110  (polled briefly, at shutdown only)
                await trio.sleep(0.02)
        for conn in list(self.connections):
            if conn.socket is not None:
                with contextlib.suppress(H2Error):
                    conn.socket.goaway()
            # Stop reading; the connection then flushes what it has queued and closes.
            conn.listening.cancel()
        with trio.move_on_after(1.0):
            while self.connections:  # noqa: ASYNC110  (polled briefly, at shutdown only)
                await trio.sleep(0.02)


async def serve_purerpc_relay(
    db: Database,
    settings: ServerSettings,
    verifier: TokenVerifier | None,
    shutdown: trio.Event,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the relay on ``settings.relay`` until ``shutdown`` is set; report ``grpc://HOST:PORT``.

    Binds only the configured host, without SO_REUSEPORT. On shutdown: stop accepting, end live
    subscriptions (UNAVAILABLE), let in-flight calls finish within the graceful timeout, then
    close every connection; queued publishes are committed before the writer stops.
    """
    relay = settings.relay_settings
    log = ChannelLog(ChannelStore(db), application_window=relay.application_epoch_window)
    auth = Authenticator(
        verifier,
        allow_anonymous=relay.allow_anonymous,
        recheck_seconds=relay.revocation_check_seconds,
    )
    server = _Relay(RelayService(log, auth, relay), settings)
    listener = await anyio.create_tcp_listener(
        local_host=settings.relay.host, local_port=settings.relay.port
    )
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with trio.open_nursery() as background:
        background.start_soon(log.run_writer)
        background.start_soon(auth.run_revocation_checks)
        async with trio.open_nursery() as connections:
            async with trio.open_nursery() as acceptors:
                for one in listener.listeners:
                    acceptors.start_soon(
                        server.accept, cast(anyio.abc.SocketListener, one), connections
                    )
                task_status.started(f"grpc://{Address(settings.relay.host, port)}")
                await shutdown.wait()
                acceptors.cancel_scope.cancel()
            await listener.aclose()
            await server.drain(relay.graceful_timeout_seconds)
            connections.cancel_scope.cancel()
        # Every call that queued a publish waited for it (shielded), so the queue is empty here.
        background.cancel_scope.cancel()
