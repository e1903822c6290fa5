"""The server's Prometheus metrics on the Python side (prometheus-client), and the exposition
that appends the relay's (``static._native.relay.RelayServer.metrics()``, the Rust
``prometheus`` crate).

Labels are bounded: an HTTP route is its template (``/v1/keys/<key_id>``, or ``unmatched``),
a method one of HTTP's own (else ``OTHER``), a token check's result one of
:data:`TOKEN_RESULTS`. No account, key, channel name or raw path is ever a label
(docs/design.md "Observability"). Updating one is a dict lookup and a lock-free add: about
2 us a request, under the noise of ``bench/e2e.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Final

from prometheus_client import REGISTRY, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = [
    "CONTENT_TYPE",
    "HTTP_METHODS",
    "TOKEN_RESULTS",
    "exposition",
    "http_request",
    "store_commit",
    "store_failure",
    "token_check",
]

CONTENT_TYPE: Final = CONTENT_TYPE_LATEST
#: Seconds: 100 us to 10 s (an API request takes ~0.3-3 ms, a store commit 0.1-10 ms).
_BUCKETS: Final = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
HTTP_METHODS: Final = frozenset(
    {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "CONNECT"}
)
#: The results of a token check: accepted, or refused and why.
TOKEN_RESULTS: Final = ("ok", "invalid_key", "invalid_token", "store_unavailable", "error")

_requests = Counter(
    "static_http_requests",
    "HTTP requests answered, by route template, method and status",
    ["route", "method", "status"],
)
_request_seconds = Histogram(
    "static_http_request_duration_seconds",
    "HTTP request latency (from routing to the response), by route template and method",
    ["route", "method"],
    buckets=_BUCKETS,
)
_token_checks = Counter(
    "static_token_checks",
    "Credential checks (API keys and JWTs), by port (http, relay) and result",
    ["port", "result"],
)
_store_commit = Histogram(
    "static_accounts_store_commit_seconds",
    "The accounts store's write transactions (SQLite or PostgreSQL), from BEGIN to COMMIT",
    buckets=_BUCKETS,
)
_store_failures = Counter(
    "static_accounts_store_failures",
    "The accounts store's write transactions that failed",
)


def http_request(route: str, method: str, status: int, seconds: float) -> None:
    """Count one answered request (``route``: its template)."""
    method = method if method in HTTP_METHODS else "OTHER"
    _requests.labels(route, method, str(status)).inc()
    _request_seconds.labels(route, method).observe(seconds)


def token_check(port: str, result: str) -> None:
    """Count one credential check on ``port`` (``http`` or ``relay``)."""
    _token_checks.labels(port, result if result in TOKEN_RESULTS else "error").inc()


@contextmanager
def store_commit() -> Iterator[None]:
    """Time one write transaction of the accounts store (however it ends)."""
    started = time.perf_counter()
    try:
        yield
    finally:
        _store_commit.observe(time.perf_counter() - started)


def store_failure() -> None:
    """Count one write transaction of the accounts store that the database failed (not a
    constraint a caller expects, such as an email taken)."""
    _store_failures.inc()


def exposition(relay_metrics: Callable[[], str] | None = None) -> bytes:
    """The text format of every metric: Python's, then the relay's (when it runs)."""
    text = generate_latest(REGISTRY)
    if relay_metrics is not None:
        text += relay_metrics().encode()
    return text
