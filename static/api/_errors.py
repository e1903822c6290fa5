"""The API's error hierarchy: every failure a client can cause, with its status and text.

Raised anywhere below the routes, turned into ``{"error": text}`` at one place (``_app``).
Texts the spec fixes are constants here; every other text is short and lower-case.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = [
    "ApiError",
    "BadRequest",
    "Conflict",
    "Forbidden",
    "MethodNotAllowed",
    "NotFound",
    "PayloadTooLarge",
    "ServiceUnavailable",
    "TooManyRequests",
    "Unauthorized",
    "UnsupportedMediaType",
]


class ApiError(Exception):
    """An error response: ``status``, the ``error`` text, and extra headers."""

    status: int = 500
    default_text: str = "internal error"

    def __init__(self, text: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        self.text = text or self.default_text
        self.headers = dict(headers or {})
        super().__init__(self.text)


class BadRequest(ApiError):
    status = 400
    default_text = "bad request"


class Unauthorized(ApiError):
    status = 401
    default_text = "missing authorization header"

    def __init__(self, text: str | None = None) -> None:
        # RFC 6750: a 401 names the scheme the client should use.
        super().__init__(text, {"WWW-Authenticate": 'Bearer realm="static"'})


class Forbidden(ApiError):
    status = 403
    default_text = "forbidden"


class NotFound(ApiError):
    status = 404
    default_text = "Not found"  # the spec's text, capital N included


class MethodNotAllowed(ApiError):
    status = 405
    default_text = "method not allowed"


class Conflict(ApiError):
    status = 409
    default_text = "conflict"


class PayloadTooLarge(ApiError):
    status = 413
    default_text = "request body too large"


class UnsupportedMediaType(ApiError):
    status = 415
    default_text = "content type must be application/json"


class TooManyRequests(ApiError):
    status = 429
    default_text = "too many requests"

    def __init__(self, retry_after: int) -> None:
        super().__init__(None, {"Retry-After": str(retry_after)})
        self.retry_after = retry_after


class ServiceUnavailable(ApiError):
    status = 503
    default_text = "service unavailable"
