"""The HTTP API: a Quart-Trio app served by hypercorn's trio worker."""

from static.api._app import create_app
from static.api._channels import NativeChannel, RelayReads
from static.api._ratelimit import AuthAttempt, AuthFailureLimiter, client_key
from static.api._serve import hypercorn_config, serve_app, serve_http, serve_metrics

__all__ = [
    "AuthAttempt",
    "AuthFailureLimiter",
    "NativeChannel",
    "RelayReads",
    "client_key",
    "create_app",
    "hypercorn_config",
    "serve_app",
    "serve_http",
    "serve_metrics",
]
