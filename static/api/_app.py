"""The Quart-Trio application: routes and the one place errors become JSON responses."""

from __future__ import annotations

from typing import Any

from quart import Response, jsonify
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from static._settings import ServerSettings
from static.store import Database

__all__ = ["create_app"]


def create_app(db: Database, settings: ServerSettings) -> QuartTrio:
    """Build the app over ``db``."""
    app = QuartTrio(__name__)
    app.config["MAX_CONTENT_LENGTH"] = settings.api.max_body_bytes

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        await db.fetchval("SELECT 1")
        return {"status": "ok"}

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> tuple[Response, int]:
        code = exc.code or 500
        return jsonify({"error": (exc.name or "error").lower()}), code

    return app
