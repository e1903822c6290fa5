"""``serve_http``: hypercorn's trio worker running the app until shutdown."""

from __future__ import annotations

from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from static._settings import ServerSettings
from static.api._app import create_app
from static.store import Database

__all__ = ["serve_http"]


async def serve_http(
    db: Database,
    settings: ServerSettings,
    shutdown: trio.Event,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the HTTP API on ``settings.http`` until ``shutdown`` is set; report the bound URL."""
    config = Config()
    config.bind = [str(settings.http)]
    config.graceful_timeout = settings.api.graceful_timeout_seconds
    config.accesslog = None
    app = create_app(db, settings)
    async with trio.open_nursery() as nursery:
        # hypercorn is stopped through its shutdown trigger, never by cancellation (DESIGN §7).
        binds: list[str] = await nursery.start(_hypercorn, app, config, shutdown)
        task_status.started(binds[0])


async def _hypercorn(
    app: Any,
    config: Config,
    shutdown: trio.Event,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    # hypercorn types task_status as _TaskStatus[None] but reports its binds through it.
    await serve(app, config, shutdown_trigger=shutdown.wait, task_status=task_status)  # type: ignore[arg-type]
