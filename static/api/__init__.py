"""The HTTP API: a Quart-Trio app served by hypercorn's trio worker."""

from static.api._serve import serve_http

__all__ = ["serve_http"]
