"""The console's files (``GET /console`` and its script and style sheet), served from the package
directory ``static/api/console/`` under a strict Content-Security-Policy.

Who may call them: anyone who reaches the port (the page holds no data: it signs in with an API
key the user types, kept in the tab's memory, and calls the JSON API with it). One call reads
nothing: the files are read once, when the app is built. Only the paths of :data:`ASSETS` are
routes: there is no path parameter, so nothing a client sends can name another file.
"""

from __future__ import annotations

from importlib import resources
from typing import Final

from quart import Response
from quart_trio import QuartTrio

__all__ = ["ASSETS", "CONTENT_SECURITY_POLICY", "install_console"]

#: The route of each file, its name in the package directory and its content type.
ASSETS: Final = {
    "/console": ("index.html", "text/html; charset=utf-8"),
    "/console/console.js": ("console.js", "text/javascript; charset=utf-8"),
    "/console/console.css": ("console.css", "text/css; charset=utf-8"),
}

#: No inline script or style, nothing from another origin, no framing, no form posts.
CONTENT_SECURITY_POLICY: Final = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
)

_HEADERS: Final = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
    # The files change only with the package; revalidating costs little.
    "Cache-Control": "no-cache",
}


def install_console(app: QuartTrio) -> None:
    """Add the console's routes to ``app``."""
    folder = resources.files("static.api") / "console"
    for route, (name, content_type) in ASSETS.items():
        body = (folder / name).read_bytes()

        async def serve(body: bytes = body, content_type: str = content_type) -> Response:
            return Response(body, status=200, content_type=content_type, headers=_HEADERS)

        app.add_url_rule(route, f"console:{name}", serve, methods=["GET"])
