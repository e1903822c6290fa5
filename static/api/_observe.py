"""The HTTP port's observability (docs/design.md "Observability"): the access log and request
metrics (hooks on the app), credential checks counted, ``GET /metrics``, ``GET /healthz``
(live) and ``GET /readyz`` (ready); :func:`metrics_response` is ``/metrics``'s answer wherever it is
served (here, or alone on ``--metrics ADDR``: :func:`static.api.serve_metrics`).

Who may call them: anyone who reaches the port. ``/healthz`` does nothing but answer;
``/readyz`` runs at most one store write probe per :data:`READY_CACHE_SECONDS` whatever the
number of callers (the others share its answer); ``/metrics`` holds aggregate counts only (no
account, key or channel). None of them is rate-limited, so that probes keep working under a
flood of other requests.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable
from typing import Any, Final, Protocol

import trio
from quart import Response, g, request
from quart_trio import QuartTrio

from static import _metrics
from static._settings import ServerSettings
from static.auth import INVALID_KEY, INVALID_TOKEN, Unauthenticated, is_api_key
from static.store import AccountStore, DatabaseError, KeyOwner

__all__ = [
    "READY_CACHE_SECONDS",
    "RelayStatus",
    "authenticated",
    "install",
    "metrics_response",
]

_access = logging.getLogger("static.access")
_log = logging.getLogger("static.api")

#: How long a ``/readyz`` answer is reused: a flood of probes costs one store write a second.
READY_CACHE_SECONDS: Final = 1.0
#: What an API key's log shows when the key is not known (its public prefix, as listed).
_PREFIX_CHARS: Final = 16
_REFUSALS: Final = {INVALID_KEY: "invalid_key", INVALID_TOKEN: "invalid_token"}


class RelayStatus(Protocol):
    """What the HTTP port reads of the relay (:class:`static.relay.RelayHandle`)."""

    def not_ready(self) -> str | None: ...

    def metrics_text(self) -> str: ...


def _note_credential(token: str) -> None:
    """What the access log may say of a credential not (yet) known: never the secret."""
    if is_api_key(token):
        g.credential = f"key_prefix={token[:_PREFIX_CHARS]}"
    elif token:
        g.credential = "credential=jwt"


async def authenticated(check: Awaitable[KeyOwner], token: str) -> KeyOwner:
    """``await check`` (an :class:`~static.auth.Authority` check of ``token``), counted by
    result and noted for the access log (the key and account ids once known)."""
    _note_credential(token)
    try:
        owner = await check
    except Unauthenticated as exc:
        _metrics.token_check("http", _REFUSALS.get(str(exc), "error"))
        raise
    except DatabaseError:
        _metrics.token_check("http", "store_unavailable")
        raise
    _metrics.token_check("http", "ok")
    g.key_id = owner.key_id
    g.account_id = owner.account_id
    return owner


class _Readiness:
    """``/readyz``'s answer: None when ready, else which part is not. One probe at a time,
    its answer reused for :data:`READY_CACHE_SECONDS`; a change is logged once."""

    def __init__(self, store: AccountStore, relay: RelayStatus | None) -> None:
        self._store = store
        self._relay = relay
        self._lock = trio.Lock()
        self._answer: str | None = "not checked yet"
        self._checked_at = -float("inf")

    def _fresh(self) -> bool:
        return trio.current_time() - self._checked_at < READY_CACHE_SECONDS

    async def check(self) -> str | None:
        if not self._fresh():
            async with self._lock:
                if not self._fresh():
                    answer = await self._probe()
                    if answer != self._answer:
                        if answer is None:
                            _log.info("ready")
                        else:
                            _log.warning("not ready: %s", answer)
                    self._answer, self._checked_at = answer, trio.current_time()
        return self._answer

    async def _probe(self) -> str | None:
        try:
            await self._store.probe_write(int(time.time() * 1000))
        except DatabaseError as exc:
            # The details go to the log only (one line per change of state, above).
            _log.error("store failure: the accounts store cannot write: %s", exc)
            return "accounts store cannot write"
        if self._relay is None:
            return None
        reason = self._relay.not_ready()
        return None if reason is None else f"relay: {reason}"


def metrics_response(relay: RelayStatus | None) -> Response:
    """``GET /metrics``: the Python side's metrics, then the relay's (when it runs here)."""
    body = _metrics.exposition(None if relay is None else relay.metrics_text)
    return Response(body, status=200, content_type=_metrics.CONTENT_TYPE)


def install(
    app: QuartTrio,
    settings: ServerSettings,
    store: AccountStore,
    relay: RelayStatus | None,
) -> None:
    """Add the access log, the request metrics and the health, readiness and metrics routes to
    ``app``. ``/metrics`` is not served here when ``settings.metrics`` gives it an address."""
    readiness = _Readiness(store, relay)

    @app.before_request
    async def start_clock() -> None:
        g.started = time.perf_counter()

    @app.after_request
    async def access_log(response: Response) -> Response:
        started: float | None = g.get("started")
        seconds = 0.0 if started is None else time.perf_counter() - started
        rule = request.url_rule
        route = rule.rule if rule is not None else "unmatched"
        _metrics.http_request(route, request.method, response.status_code, seconds)
        if _access.isEnabledFor(logging.INFO):
            fields: dict[str, Any] = {
                "method": request.method,
                "route": route,
                "status": response.status_code,
                "duration_ms": round(seconds * 1000, 3),
                "client": request.remote_addr or "",
            }
            who = ""
            key_id = g.get("key_id")
            if key_id is not None:
                fields["key_id"] = key_id
                fields["account_id"] = g.get("account_id")
                who = f" key={key_id} account={fields['account_id']}"
            elif (credential := g.get("credential")) is not None:
                who = " " + credential
                fields["credential"] = credential
            _access.info(
                "%s %s %s %.3fms client=%s%s",
                request.method[:16],
                route,
                response.status_code,
                seconds * 1000,
                fields["client"],
                who,
                extra={"http": fields},
            )
        return response

    @app.get("/healthz")
    async def healthz() -> Response:
        # Live: the process answers. Whether it can serve is /readyz's question.
        return Response(b'{"status":"ok"}', status=200, content_type="application/json")

    @app.get("/readyz")
    async def readyz() -> Response:
        reason = await readiness.check()
        if reason is None:
            return Response(b'{"status":"ready"}', status=200, content_type="application/json")
        body = json.dumps({"error": f"not ready: {reason}"})
        return Response(body, status=503, content_type="application/json")

    if settings.metrics is None:

        @app.get("/metrics")
        async def metrics() -> Response:
            return metrics_response(relay)
