"""``serve_relay``: the relay of ``static serve``, on whichever store it was given.

On SQLite (a file) the data plane is the Rust relay (:mod:`static.relay._rust`): the Python one
cannot reach the round-trip latency the SDK is measured by. On PostgreSQL the relay in Python
(:mod:`static.relay._purerpc`) serves, until the Rust one has a PostgreSQL log of its own.
"""

from __future__ import annotations

import trio

from static._settings import ServerSettings
from static.auth import TokenVerifier
from static.relay._purerpc import serve_purerpc_relay
from static.relay._rust import serve_rust_relay
from static.store import Database
from static.store._sqlite import SQLiteDatabase

__all__ = ["serve_relay"]


async def serve_relay(
    db: Database,
    settings: ServerSettings,
    verifier: TokenVerifier | None,
    shutdown: trio.Event,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the relay on ``settings.relay`` until ``shutdown`` is set; report ``grpc://HOST:PORT``
    through ``task_status`` once it listens."""
    if isinstance(db, SQLiteDatabase) and db.path != ":memory:":
        await serve_rust_relay(db.path, settings, verifier, shutdown, task_status=task_status)
    elif not isinstance(db, SQLiteDatabase):
        await serve_rust_relay(
            settings.resolved_database_url, settings, verifier, shutdown, task_status=task_status
        )
    else:
        await serve_purerpc_relay(db, settings, verifier, shutdown, task_status=task_status)
