"""The one ``static serve`` process: the HTTP API and the relay in one trio nursery, one store.

Every long-running part is ``serve_x(..., *, task_status)`` and reports what it bound through
``task_status.started``; :func:`serve` composes them with ``nursery.start``. Signals, config and
exit codes belong to ``static.cli.main`` alone: :func:`serve` stops when ``shutdown`` is set.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import trio

from static._datadir import hold_database, prepare_data_dir
from static._settings import ServerSettings
from static.api import serve_http, serve_metrics
from static.auth import open_authority
from static.relay import RelayHandle, serve_relay
from static.store import open_database

__all__ = ["BoundServer", "serve"]


@dataclass(frozen=True, slots=True)
class BoundServer:
    """Where the server listens, once it does."""

    http_url: str
    relay_url: str
    #: Where ``GET /metrics`` is served alone (``--metrics``), else None (the HTTP port).
    metrics_url: str | None = None


async def serve(
    settings: ServerSettings,
    shutdown: trio.Event,
    *,
    task_status: trio.TaskStatus[BoundServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the server until ``shutdown`` is set, then drain and return.

    The :class:`~static.auth.Authority` (``authority``) is built once here and shared: the HTTP
    API mints and checks credentials with it, and the relay verifies JWTs through it (it is
    the concrete :class:`~static.auth.TokenVerifier`). It outlives the servers in the nursery,
    so its last flush of key use runs after they drained. A SQLite database stays locked
    meanwhile (:func:`~static._datadir.hold_database`: another server on it is refused).
    """
    prepare_data_dir(settings.data_dir)
    async with (
        hold_database(settings.resolved_database_url),
        open_database(settings.resolved_database_url) as db,
        open_authority(db, settings.api) as authority,
        trio.open_nursery() as nursery,
    ):
        # What /readyz and /metrics read of the relay, once it listens.
        relay = RelayHandle()
        http_url: str = await nursery.start(
            partial(serve_http, relay=relay), db, settings, authority, shutdown
        )
        relay_url: str = await nursery.start(
            partial(serve_relay, handle=relay), settings, authority, shutdown
        )
        metrics_url = None
        if settings.metrics is not None:
            metrics_url = await nursery.start(serve_metrics, settings, relay, shutdown)
        task_status.started(
            BoundServer(http_url=http_url, relay_url=relay_url, metrics_url=metrics_url)
        )
