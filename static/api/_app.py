"""The Quart-Trio application: the routes, and the one place errors become JSON responses.

Routes are thin: authenticate through the :class:`~static.auth.Authority`, then the cheap
refusals (rate limits, the key's scope, the input's shape: ``_validation``), and only then the
store; shape the JSON. Each route says who may call it and what one call costs. Every failure
is an exception mapped to ``{"error": text}`` by :func:`_error_response`; nothing reaches the
client as HTML or a traceback, and a storage failure is a 503.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from static._settings import ServerSettings
from static._time import iso_utc
from static.api._channels import RelayReads, channel_page, message_rate, parse_channels_query
from static.api._console import install_console
from static.api._errors import (
    ApiError,
    Conflict,
    Forbidden,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    ServiceUnavailable,
    TooManyRequests,
    Unauthorized,
)
from static.api._observe import authenticated as observed
from static.api._observe import install as install_observability
from static.api._openapi import openapi_document
from static.api._ratelimit import AuthAttempt, AuthFailureLimiter, RateLimiter, client_key
from static.api._validation import (
    bearer_token,
    parse_audit_query,
    parse_grace,
    parse_json_object,
    parse_key_id,
    parse_key_rules,
    parse_new_account,
    parse_new_key,
)
from static.auth import (
    Authority,
    Unauthenticated,
    generate_api_key,
    is_api_key,
    looks_like_jwt,
)
from static.store import (
    AccountRecord,
    AuditStore,
    Database,
    DatabaseError,
    EmailTaken,
    KeyLimitReached,
    KeyOwner,
    KeyRecord,
    NewKey,
)

__all__ = ["create_app"]

_log = logging.getLogger("static.api")


def _timestamp(value: datetime | None) -> str | None:
    """ISO 8601 UTC with a ``Z`` suffix (microsecond precision), or None."""
    return None if value is None else iso_utc(value)


def _account_json(account: AccountRecord) -> dict[str, Any]:
    return {
        "id": account.id,
        "email": account.email,
        "name": account.name,
        "plan_tier": account.plan_tier,
    }


def _key_json(record: KeyRecord) -> dict[str, Any]:
    """What create and roll return besides the secret, and list beside its own fields."""
    return {
        "scopes": list(record.scopes),
        "channels": None if record.channels is None else list(record.channels),
        "expires_at": _timestamp(record.expires_at),
    }


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    from quart import current_app

    response: Response = current_app.json.response(body)  # type: ignore[assignment]
    response.status_code = status
    if headers:
        response.headers.update(headers)
    return response


def _error_response(exc: BaseException) -> Response:
    """The one mapping from an exception to the JSON error a client sees."""
    if isinstance(exc, ApiError):
        return _json({"error": exc.text}, exc.status, exc.headers)
    if isinstance(exc, Unauthenticated):
        return _error_response(Unauthorized(str(exc)))
    if isinstance(exc, RequestEntityTooLarge):
        return _error_response(PayloadTooLarge())
    if isinstance(exc, HTTPException):
        code = exc.code or 500
        if code == 404:
            return _error_response(NotFound())
        if code == 405:
            allow = dict(exc.get_headers()).get("Allow", "")
            return _error_response(MethodNotAllowed(headers={"Allow": allow} if allow else None))
        if code >= 500:
            _log.error("HTTP error %s: %s", code, exc.description)
        return _json({"error": (exc.name or "error").lower()}, code)
    if isinstance(exc, DatabaseError):
        _log.error("storage failure: %s", exc)
        return _error_response(ServiceUnavailable())
    _log.error("unexpected error", exc_info=exc)
    return _json({"error": "internal error"}, 500)


def create_app(
    db: Database,
    settings: ServerSettings,
    authority: Authority,
    relay: RelayReads | None = None,
) -> QuartTrio:
    """Build the app over ``db`` and ``authority``; ``/readyz``, ``/metrics`` and the channel
    reads also read ``relay`` (the relay of the same process) when given (without it, the
    channel reads answer 503)."""
    api = settings.api
    store = authority.store
    # No static files: Quart would otherwise serve a /static/<path> route.
    app = QuartTrio(__name__, static_folder=None)
    app.config["MAX_CONTENT_LENGTH"] = api.max_body_bytes
    # A client trickling its body holds a request slot; 60 s (Quart's default) is too generous.
    app.config["BODY_TIMEOUT"] = 10
    app.json.sort_keys = False  # type: ignore[attr-defined]
    # "//v1//keys" is not a route of ours: a 404, never a redirect.
    app.url_map.merge_slashes = False
    signup_limiter = RateLimiter(api.signup_rate_limit) if api.signup_rate_limit else None
    key_limiter = RateLimiter(api.key_rate_limit) if api.key_rate_limit else None
    account_limiter = RateLimiter(api.account_rate_limit) if api.account_rate_limit else None
    audit = AuditStore(db)
    auth_limiter = (
        AuthFailureLimiter(api.auth_failure_rate_limit) if api.auth_failure_rate_limit else None
    )
    openapi = openapi_document()
    # First: its clock starts before the other hooks run (docs/design.md "Observability").
    install_observability(app, settings, store, relay)

    # -- helpers ----------------------------------------------------------------------------

    async def read_json_object() -> dict[str, Any]:
        body = await request.get_data(cache=False, as_text=False)
        assert isinstance(body, bytes)
        return parse_json_object(body, request.headers.get("Content-Type"))

    def limit_key(owner: KeyOwner) -> None:
        """The key's rate, then its account's (all its keys and JWTs together)."""
        now = time.monotonic()
        if key_limiter is not None:
            wait = key_limiter.acquire(owner.key_id, now)
            if wait is not None:
                raise TooManyRequests(wait)
        if account_limiter is not None:
            wait = account_limiter.acquire(owner.account_id, now)
            if wait is not None:
                # Refused: the key's token is not spent on a request that was not served.
                if key_limiter is not None:
                    key_limiter.refund(owner.key_id, now)
                raise TooManyRequests(wait)

    def found(owner: KeyOwner) -> AccountRecord:
        # A key whose account row is gone: the spec's 404 of GET /v1/accounts/me.
        if owner.account is None:
            raise NotFound()
        return owner.account

    def address() -> str:
        return client_key(request.remote_addr or "")

    def digest(token: str) -> bytes:
        return hashlib.sha256(token.encode()).digest()

    def start_attempt(where: str, credential: bytes | None) -> AuthAttempt:
        """The check of ``credential`` from ``where``, its failure paid; 429 if none is left."""
        assert auth_limiter is not None
        started = auth_limiter.attempt(where, credential, time.monotonic())
        if isinstance(started, int):
            raise TooManyRequests(started)
        return started

    async def authenticated(check: Callable[[str], Awaitable[KeyOwner]]) -> KeyOwner:
        """The owner of the request's bearer token as ``check`` finds it; every failure
        (a 401) counts against the client's address, and an address past its failures is
        refused (429) before its credential is looked at, unless that credential worked from
        there lately (``AuthFailureLimiter``). The failure is paid before ``check`` awaits and
        given back when the credential works: concurrent guesses cannot outrun the count."""
        if auth_limiter is None:
            return await check(bearer_token(request.headers.getlist("Authorization")))
        where = address()
        try:
            token = bearer_token(request.headers.getlist("Authorization"))
        except Unauthorized:
            # No credential to recognise: 429 past the address's failures, else this 401.
            start_attempt(where, None).failed(time.monotonic())
            raise
        credential = digest(token)
        pending = start_attempt(where, credential)
        try:
            owner = await check(token)
        except (Unauthorized, Unauthenticated):
            pending.failed(time.monotonic())
            raise
        except DatabaseError:
            # A 503 is the store's failure, not the caller's.
            pending.abandoned(time.monotonic())
            raise
        pending.succeeded(time.monotonic())
        return owner

    async def key_only(token: str) -> KeyOwner:
        if not is_api_key(token) and looks_like_jwt(token):
            raise Unauthorized("api key required")
        return await observed(authority.authenticate_key(token), token)

    async def key_or_token(token: str) -> KeyOwner:
        if is_api_key(token) or not looks_like_jwt(token):
            return await observed(authority.authenticate_key(token), token)
        return await observed(authority.authenticate_token(token), token)

    async def api_key_owner(scope: str) -> KeyOwner:
        """The caller of a key endpoint, which takes an API key only (a JWT is refused) that
        holds ``scope``."""
        owner = await authenticated(key_only)
        limit_key(owner)
        if scope not in owner.scopes:
            raise Forbidden(f"api key lacks the {scope} scope")
        found(owner)
        return owner

    # -- hooks ------------------------------------------------------------------------------

    @app.before_request
    async def refuse_oversized_bodies() -> None:
        # Also for routes that never read their body (Quart checks only when it is read).
        length = request.content_length
        if length is not None and length > api.max_body_bytes:
            raise PayloadTooLarge()

    @app.after_request
    async def no_store(response: Response) -> Response:
        # Responses carry secrets or per-caller data: no cache keeps them, unless a route says so.
        response.headers.setdefault("Cache-Control", "no-store")
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        return response

    @app.errorhandler(Exception)
    async def any_error(exc: Exception) -> Response:
        response = _error_response(exc)
        # An error may be answered before the body was read (a 413, a 401): on HTTP/1.x the
        # unread rest would be taken for the next request, so the connection ends here.
        has_body = request.content_length or "Transfer-Encoding" in request.headers
        if has_body and request.http_version.startswith("1"):
            response.headers["Connection"] = "close"
        return response

    # -- routes -----------------------------------------------------------------------------

    @app.post("/v1/accounts")
    async def create_account() -> Response:
        if signup_limiter is not None:
            wait = signup_limiter.acquire(client_key(request.remote_addr or ""), time.monotonic())
            if wait is not None:
                raise TooManyRequests(wait)
        new = parse_new_account(await read_json_object())
        key = generate_api_key()
        try:
            account = await store.create_account(
                account_id=str(uuid.uuid4()),
                email=new.email,
                name=new.name,
                first_key=NewKey(str(uuid.uuid4()), key.digest, key.key_prefix, "default"),
                now=datetime.now(UTC),
            )
        except EmailTaken:
            raise Conflict("email already registered") from None
        return _json({"account": _account_json(account), "api_key": key.secret})

    @app.get("/v1/accounts/me")
    async def me() -> Response:
        # Any working key or JWT, no scope; one lookup.
        owner = await authenticated(key_or_token)
        limit_key(owner)
        return _json(_account_json(found(owner)))

    def created(record: KeyRecord, secret: str) -> Response:
        return _json(
            {
                "id": record.id,
                "key_prefix": record.key_prefix,
                "name": record.name,
                "key": secret,
                **_key_json(record),
            }
        )

    @app.post("/v1/keys")
    async def create_key() -> Response:
        # A key with the keys scope; one lookup, then one write transaction (count, insert,
        # audit event).
        owner = await api_key_owner("keys")
        body = await read_json_object()
        name = parse_new_key(body)
        rules = parse_key_rules(body, api.max_key_lifetime_seconds)
        key = generate_api_key()
        new = NewKey(
            str(uuid.uuid4()),
            key.digest,
            key.key_prefix,
            name,
            rules.scopes,
            rules.channels,
            rules.expires_in,
        )
        try:
            record = await store.create_key(
                owner.account_id,
                new,
                now=datetime.now(UTC),
                max_active=api.max_keys_per_account,
                actor=owner.key_id,
            )
        except KeyLimitReached:
            raise Conflict("too many active keys") from None
        return created(record, key.secret)

    @app.post("/v1/keys/<key_id>/roll")
    async def roll_key(key_id: str) -> Response:
        # A key with the keys scope (any key of the account, itself included); one lookup,
        # then one write transaction (count, read the old key, insert, mark, audit event).
        owner = await api_key_owner("keys")
        grace = parse_grace(await read_json_object())
        old_id = parse_key_id(key_id)
        key = generate_api_key()
        try:
            record = await store.roll_key(
                owner.account_id,
                old_id,
                # Name, scopes, channels and lifetime are the old key's (the store reads them).
                NewKey(str(uuid.uuid4()), key.digest, key.key_prefix, ""),
                now=datetime.now(UTC),
                grace_seconds=grace,
                max_active=api.max_keys_per_account,
                default_lifetime=api.max_key_lifetime_seconds,
                actor=owner.key_id,
            )
        except KeyLimitReached:
            raise Conflict("too many active keys") from None
        if record is None:
            raise NotFound()
        return created(record, key.secret)

    @app.get("/v1/keys")
    async def list_keys() -> Response:
        # A key with the keys scope; one lookup, one indexed read (at most 100 rows).
        owner = await api_key_owner("keys")
        keys = []
        for record in await store.active_keys(owner.account_id, datetime.now(UTC)):
            # A use not flushed yet is newer than the stored one.
            last_used = authority.last_used(record.id) or record.last_used_at
            keys.append(
                {
                    "id": record.id,
                    "key_prefix": record.key_prefix,
                    "name": record.name,
                    "last_used_at": _timestamp(last_used),
                    "created_at": _timestamp(record.created_at),
                    **_key_json(record),
                }
            )
        return _json({"keys": keys})

    @app.delete("/v1/keys/<key_id>")
    async def revoke_key(key_id: str) -> Response:
        # A key with the keys scope; one lookup, one write transaction (update, audit event);
        # the revocation listeners hear of it.
        owner = await api_key_owner("keys")
        if not await authority.revoke_key(
            owner.account_id, parse_key_id(key_id), actor=owner.key_id
        ):
            raise NotFound()
        response = Response(b"", status=204)
        del response.headers["Content-Type"]
        return response

    @app.post("/v1/tokens")
    async def exchange_token() -> Response:
        # No body is needed; one sent anyway is ignored (past the size limit it is a 413).
        # A key with the channels scope; one lookup and one signature.
        owner = await api_key_owner("channels")
        issued = authority.mint(owner)
        if auth_limiter is not None:
            # The token works from where its key does (a client may use it on /me at once).
            auth_limiter.succeeded(address(), digest(issued.access_token))
        return _json(
            {
                "access_token": issued.access_token,
                "token_type": "Bearer",
                "expires_in": issued.expires_in,
            },
            headers={"Cache-Control": "no-store", "Pragma": "no-cache"},
        )

    @app.get("/v1/audit")
    async def audit_log() -> Response:
        # A key with the keys scope; one lookup, then one indexed read of each source (at most
        # limit + 1 rows each).
        owner = await api_key_owner("keys")
        query = parse_audit_query(request.args)
        since_ms = int((time.time() - api.audit_retention_days * 86_400) * 1000)
        page = await audit.page(
            owner.account_id, limit=query.limit, cursor=query.cursor, since_ms=since_ms
        )
        return _json({"events": page.events, "next_cursor": page.next_cursor})

    @app.get("/v1/channels")
    async def list_channels() -> Response:
        # A key with the channels scope; one lookup, then the relay's bounded read on a thread
        # (``_channels``): the account's channels, those matching the key's patterns.
        owner = await api_key_owner("channels")
        limit, after = parse_channels_query(request.args)
        return _json(await channel_page(relay, owner.account_id, owner.channels, limit, after))

    @app.get("/v1/channels/rate")
    async def channel_rate() -> Response:
        # A key with the channels scope; one lookup, then one indexed count on a thread.
        owner = await api_key_owner("channels")
        return _json(await message_rate(relay, owner.account_id, owner.channels))

    install_console(app)

    @app.get("/.well-known/jwks.json")
    async def jwks() -> Response:
        return _json(authority.jwks(), headers={"Cache-Control": "public, max-age=300"})

    @app.get("/v1/openapi.json")
    async def openapi_json() -> Response:
        return _json(openapi, headers={"Cache-Control": "public, max-age=300"})

    return app
