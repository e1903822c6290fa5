"""``serve_relay``: the relay of ``static serve``, on whichever store it was given.

One relay serves both stores: the Rust one (:mod:`static.relay._rust`), which opens the store's
database itself, beside the HTTP API's connections: the SQLite file, or the PostgreSQL database
(which several ``static serve`` processes may share).
"""

from __future__ import annotations

import trio

from static._settings import ServerSettings
from static.auth import TokenVerifier
from static.relay._handle import RelayHandle
from static.relay._rust import serve_rust_relay
from static.store import relay_database

__all__ = ["serve_relay"]


async def serve_relay(
    settings: ServerSettings,
    verifier: TokenVerifier | None,
    shutdown: trio.Event,
    *,
    handle: RelayHandle | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the relay on ``settings.relay`` over the (already migrated) database of
    ``settings`` until ``shutdown`` is set; report ``grpc://HOST:PORT`` through ``task_status``
    once it listens; ``handle`` then reads its health and metrics."""
    database = relay_database(settings.resolved_database_url)
    await serve_rust_relay(
        database, settings, verifier, shutdown, handle=handle, task_status=task_status
    )
