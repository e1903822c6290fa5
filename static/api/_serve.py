"""``serve_http``: hypercorn's trio worker running the app until shutdown."""

from __future__ import annotations

from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from static._settings import ServerSettings
from static.api._app import create_app
from static.auth import Authority
from static.store import Database

__all__ = ["hypercorn_config", "serve_app", "serve_http"]


def hypercorn_config(settings: ServerSettings) -> Config:
    """The hypercorn configuration of the API (the benchmark's baseline uses it too)."""
    config = Config()
    config.bind = [str(settings.http)]
    config.graceful_timeout = settings.api.graceful_timeout_seconds
    config.accesslog = None
    config.include_server_header = False
    # Bounds the damage of HTTP/2 rapid reset on one connection (DESIGN §7).
    config.keep_alive_max_requests = 1000
    config.backlog = 1024
    return config


async def serve_http(
    db: Database,
    settings: ServerSettings,
    authority: Authority,
    shutdown: trio.Event,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the HTTP API on ``settings.http`` until ``shutdown`` is set; report the bound URL."""
    await serve_app(
        create_app(db, settings, authority),
        hypercorn_config(settings),
        shutdown,
        task_status=task_status,
    )


async def serve_app(
    app: Any,
    config: Config,
    shutdown: trio.Event,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` with ``config`` until ``shutdown`` is set (in-flight requests finish)."""
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
