"""``serve_http`` and ``serve_metrics``: hypercorn's trio worker running an app until shutdown."""

from __future__ import annotations

import json
import logging
import os
import weakref
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from hypercorn.trio.tcp_server import TCPServer
from quart import Response
from quart_trio import QuartTrio

from static._settings import ServerSettings
from static.api._app import create_app
from static.api._channels import RelayReads
from static.api._connections import ConnectionCaps
from static.api._h11 import install as install_h11_fixes
from static.api._observe import RelayStatus, metrics_response
from static.auth import Authority
from static.store import Database

__all__ = ["hypercorn_config", "serve_app", "serve_http", "serve_metrics"]

_log = logging.getLogger("static.api")

#: The connection caps of each served configuration (read by the wrapped ``TCPServer.run``).
_CAPS: weakref.WeakKeyDictionary[Config, ConnectionCaps] = weakref.WeakKeyDictionary()


def hypercorn_config(settings: ServerSettings) -> Config:
    """The hypercorn configuration of the API (the benchmark's baseline uses it too)."""
    config = Config()
    config.bind = [str(settings.http)]
    config.graceful_timeout = settings.api.graceful_timeout_seconds
    config.accesslog = None
    # hypercorn's own records go through the process's logging (static.cli configures it),
    # not a handler of its own: one format on stderr (the access log is static.access).
    config.errorlog = logging.getLogger("hypercorn.error")
    config.include_server_header = False
    # Bounds the damage of HTTP/2 rapid reset on one connection (docs/design.md §7).
    config.keep_alive_max_requests = 1000
    config.backlog = 1024
    if settings.tls is not None:
        # HTTP/1.1 and h2 through ALPN (hypercorn's default protocols), TLS 1.2+.
        config.certfile = str(settings.tls.cert)
        config.keyfile = str(settings.tls.key)
        # A peer that never completes its handshake holds its connection cap only this long
        # (the caps are taken before the handshake, in ``_contain_connection_errors``).
        config.ssl_handshake_timeout = settings.api.tls_handshake_timeout_seconds
    return config


async def serve_http(
    db: Database,
    settings: ServerSettings,
    authority: Authority,
    shutdown: trio.Event,
    *,
    relay: RelayReads | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the HTTP API on ``settings.http`` until ``shutdown`` is set; report the bound URL.
    ``relay``: the relay of this process, for ``/readyz``, ``/metrics`` and ``/v1/channels``."""
    await serve_app(
        create_app(db, settings, authority, relay),
        hypercorn_config(settings),
        shutdown,
        caps=ConnectionCaps(settings.api.max_connections, settings.api.max_connections_per_address),
        task_status=task_status,
    )


async def serve_metrics(
    settings: ServerSettings,
    relay: RelayStatus | None,
    shutdown: trio.Event,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``GET /metrics`` alone on ``settings.metrics`` (``--metrics ADDR``) until
    ``shutdown`` is set; report the bound URL."""
    assert settings.metrics is not None
    app = QuartTrio("static.metrics", static_folder=None)

    @app.get("/metrics")
    async def metrics() -> Response:
        return metrics_response(relay)

    @app.errorhandler(Exception)
    async def any_error(exc: Exception) -> Response:
        code = getattr(exc, "code", None)
        status = code if isinstance(code, int) and 400 <= code < 500 else 500
        body = json.dumps({"error": "not found" if status == 404 else "error"})
        return Response(body, status=status, content_type="application/json")

    config = hypercorn_config(settings)
    config.bind = [str(settings.metrics)]
    await serve_app(app, config, shutdown, task_status=task_status)


class _ShieldFinalSend:
    """ASGI middleware: the last ``send`` of an HTTP response runs shielded from cancellation.

    hypercorn (0.17.3, still 0.18.0) recycles a keep-alive connection (and starts its idle
    timer) inside that last ``send``, which tells the app the stream is over; Quart-Trio reacts
    by cancelling its request nursery, which cancels the recycling half-way. The connection then
    never gets an idle timer: idle keep-alive connections live forever, and a shutdown waits the
    whole graceful timeout for them. Shielding is safe: hypercorn shields its socket writes
    already.
    """

    def __init__(self, app: Any) -> None:
        self._app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return

        async def shielded_send(message: Any) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                with trio.CancelScope(shield=True):
                    await send(message)
            else:
                await send(message)

        await self._app(scope, receive, shielded_send)


def _contain_connection_errors() -> None:
    """Make a failing connection handler end its connection, not the whole server; and hold
    every connection to its configuration's caps (:class:`ConnectionCaps`).

    hypercorn (0.17.3, still 0.18.0) runs every connection in the server's nursery, so an
    exception in one kills the process. One is reachable by any client: an HTTP/2 (h2c) request
    answered before its body arrived (a 401, a 413) makes the next DATA frame raise
    ``KeyError`` in ``H2Protocol._handle_events``. Idempotent; trio.Cancelled passes through.
    """
    if getattr(TCPServer.run, "_static_contained", False):
        return
    original = TCPServer.run

    async def run(self: TCPServer) -> None:
        caps = _CAPS.get(self.config)
        key = None
        if caps is not None:
            key = _admit(caps, self.stream)
            if key is None:
                # Closed before anything is read: a refusal costs an accept and a close.
                with trio.CancelScope(shield=True):
                    await self.stream.aclose()
                return
        try:
            await original(self)
        except* Exception:  # noqa: BLE001  (any failure of one connection, logged below)
            _log.warning("connection closed after a server error", exc_info=True)
        finally:
            if caps is not None and key is not None:
                caps.release(key)

    run._static_contained = True  # type: ignore[attr-defined]
    TCPServer.run = run  # type: ignore[method-assign]


def _admit(caps: ConnectionCaps, stream: Any) -> str | None:
    """A place in ``caps`` for the connection on ``stream``; None to refuse it (a cap is
    reached, or the peer is gone already)."""
    sock = getattr(stream, "socket", None) or stream.transport_stream.socket
    try:
        address = sock.getpeername()[0]
    except OSError:
        return None
    return caps.admit(str(address))


async def serve_app(
    app: Any,
    config: Config,
    shutdown: trio.Event,
    *,
    caps: ConnectionCaps | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the Quart-Trio ``app`` with ``config`` until ``shutdown`` is set (in-flight
    requests finish); with ``caps``, connections beyond them are closed as they come."""
    _contain_connection_errors()
    # CL+TE refused, JSON error bodies, lingering close (static/api/_h11.py).
    install_h11_fixes()
    if caps is not None:
        _CAPS[config] = caps
    app.asgi_app = _ShieldFinalSend(app.asgi_app)
    async with trio.open_nursery() as nursery:
        # hypercorn is stopped through its shutdown trigger, never by cancellation
        # (docs/design.md §7).
        try:
            binds: list[str] = await nursery.start(_hypercorn, app, config, shutdown)
        except* OSError as failed:
            # Before it listened: the bind. hypercorn says only "[Errno 98] Address already
            # in use", not where.
            raise _cannot_listen(config, failed) from None
        task_status.started(binds[0])


def _cannot_listen(config: Config, failed: BaseExceptionGroup[OSError]) -> OSError:
    """``cannot listen on HOST:PORT: why``, for the first failure in ``failed``."""
    error: BaseException = failed
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    why = os.strerror(error.errno).lower() if isinstance(error, OSError) and error.errno else error
    return OSError(f"cannot listen on {', '.join(config.bind)}: {why}")


async def _hypercorn(
    app: Any,
    config: Config,
    shutdown: trio.Event,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    await serve(app, config, shutdown_trigger=shutdown.wait, task_status=task_status)
