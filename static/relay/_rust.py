"""``serve_rust_relay``: the relay's data plane in Rust (``static._native.RelayServer``).

The gRPC service, the channel logs and their group-committing writer run on a tokio runtime of
the extension, in this process, on the same database as the HTTP API (a SQLite file, or a
PostgreSQL database that other ``static serve`` processes may share); no message crosses into
Python. What stays here is what is not per message: tokens are checked by the server's
:class:`~static.auth.TokenVerifier` once per call (behind the HTTP port's limit on failed
authentications per client address, :class:`~static.api.AuthFailureLimiter`, with a budget of
its own), the keys behind live streams are re-checked
for revocation every ``revocation_check_seconds``, and shutdown is decided here.

The extension asks for token checks from its own threads. They are answered by a task of this
module's nursery rather than by ``trio.from_thread.run``: a task started from a foreign thread
would lack this task's context, which the PostgreSQL store (triopg, over trio-asyncio) needs.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial

import trio

from static import _metrics
from static._native import RelayServer
from static._settings import Address, ServerSettings
from static.api import AuthAttempt, AuthFailureLimiter, client_key
from static.auth import INVALID_TOKEN, TokenVerifier
from static.auth import Unauthenticated as TokenRefused
from static.relay._handle import RelayHandle
from static.store import DatabaseError

__all__ = ["serve_rust_relay"]

#: gRPC codes ``verify`` refuses with.
_RESOURCE_EXHAUSTED = 8
_UNAVAILABLE = 14
_UNAUTHENTICATED = 16

#: A principal, a refusal ``(code, text)``, or ``(RESOURCE_EXHAUSTED, text, retry after s)``.
_Verified = tuple[str, str, float | None] | tuple[int, str] | tuple[int, str, int]
_SHUTTING_DOWN: _Verified = (_UNAVAILABLE, "relay is shutting down")

_log = logging.getLogger("static.auth")


@dataclass(frozen=True)
class _Request:
    token: str
    #: The caller's ``ip:port``, as the extension names it.
    peer: str
    answer: Future[_Verified]


async def _check(
    verifier: TokenVerifier,
    token: str,
    peer: str = "",
    limiter: AuthFailureLimiter | None = None,
) -> _Verified:
    """The principal, or a refusal. Never raises: an exception here would end the verification
    task's nursery, and with it the whole process.

    With ``limiter``, every refusal counts against the peer's address, and an address past its
    failures is refused (RESOURCE_EXHAUSTED, with the seconds to wait) before the token is
    checked, unless that token worked from there lately: the HTTP port's rule (docs/design.md
    §4.1). The failure is paid before the check awaits, and given back if the token works."""
    attempt: AuthAttempt | None = None
    if limiter is not None:
        where = client_key(peer.rpartition(":")[0] or peer)
        credential = hashlib.sha256(token.encode()).digest()
        started = limiter.attempt(where, credential, time.monotonic())
        if isinstance(started, int):
            return (
                _RESOURCE_EXHAUSTED,
                "too many failed authentications from this address",
                started,
            )
        attempt = started
    try:
        principal = await verifier.verify_token(token)
    except TokenRefused as exc:
        refusal = (_UNAUTHENTICATED, str(exc) or "invalid token")
    except DatabaseError as exc:
        if attempt is not None:
            attempt.abandoned(time.monotonic())
        return (_UNAVAILABLE, f"store unavailable: {exc}")
    except Exception as exc:  # noqa: BLE001  (a verifier bug refuses this call only)
        _log.warning(
            "relay call refused after an unexpected %s in the token check", type(exc).__name__
        )
        refusal = (_UNAUTHENTICATED, INVALID_TOKEN)
    else:
        if attempt is not None:
            attempt.succeeded(time.monotonic())
        return (principal.account_id, principal.key_id, principal.expires_at)
    if attempt is not None:
        attempt.failed(time.monotonic())
    return refusal


def _token_result(answer: _Verified) -> str:
    """The token check's result, for its metric."""
    if isinstance(answer[0], str):  # a principal: (account_id, key_id, expires_at)
        return "ok"
    if answer[0] == _UNAVAILABLE:
        return "store_unavailable"
    if answer[0] == _RESOURCE_EXHAUSTED:
        return "rate_limited"
    return "invalid_token"


async def _answer(
    verifier: TokenVerifier, limiter: AuthFailureLimiter | None, request: _Request
) -> None:
    answer = _SHUTTING_DOWN
    try:
        answer = await _check(verifier, request.token, request.peer, limiter)
        _metrics.token_check("relay", _token_result(answer))
    finally:
        # Cancelled (shutdown) too: the extension's thread waits for an answer.
        request.answer.set_result(answer)


async def _serve_verifications(
    verifier: TokenVerifier,
    limiter: AuthFailureLimiter | None,
    requests: trio.MemoryReceiveChannel[_Request],
) -> None:
    """Answer the extension's token checks, each in a task of its own, until cancelled."""
    try:
        async with trio.open_nursery() as nursery:
            async for request in requests:
                nursery.start_soon(_answer, verifier, limiter, request)
    finally:
        requests.close()
        # Asked before the channel closed, never taken: refused.
        while True:
            try:
                request = requests.receive_nowait()
            except (trio.WouldBlock, trio.ClosedResourceError, trio.EndOfChannel):
                break
            request.answer.set_result(_SHUTTING_DOWN)


def _verify_from_threads(
    requests: trio.MemorySendChannel[_Request], trio_token: trio.lowlevel.TrioToken
) -> Callable[[str, str], _Verified]:
    """``verify(token, peer)`` for the extension's threads: hands the token to
    :func:`_serve_verifications` and waits for its answer."""

    def verify(token: str, peer: str) -> _Verified:
        request = _Request(token, peer, Future())
        try:
            trio.from_thread.run_sync(requests.send_nowait, request, trio_token=trio_token)
        except (trio.RunFinishedError, trio.BrokenResourceError, trio.ClosedResourceError):
            return _SHUTTING_DOWN
        return request.answer.result()

    return verify


async def _revocation_checks(server: RelayServer, verifier: TokenVerifier, every: float) -> None:
    """End the streams of keys that are no longer active (revocation voids their tokens)."""
    while True:
        await trio.sleep(every)
        for key in server.live_keys():
            try:
                active = await verifier.key_is_active(key)
            except DatabaseError:
                continue  # A store hiccup must not end the checks: try again next round.
            if not active:
                server.end_streams_of_key(key, "api key revoked")


async def serve_rust_relay(
    database: str,
    settings: ServerSettings,
    verifier: TokenVerifier | None,
    shutdown: trio.Event,
    *,
    handle: RelayHandle | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the relay on ``settings.relay`` over ``database`` (a SQLite file or a PostgreSQL URL,
    already migrated) until ``shutdown`` is set; report ``grpc://HOST:PORT`` (``https://HOST:PORT``
    with ``settings.tls``: the relay terminates TLS itself, rustls).

    Binds only the configured host, without SO_REUSEPORT. On shutdown: stop accepting, end live
    subscriptions (UNAVAILABLE), let in-flight calls finish within the graceful timeout, close
    every connection, commit what was submitted.
    """
    relay = settings.relay_settings
    tls = settings.tls
    requests_in, requests_out = trio.open_memory_channel[_Request](math.inf)
    verify = (
        None
        if verifier is None
        else _verify_from_threads(requests_in, trio.lowlevel.current_trio_token())
    )
    start = partial(
        RelayServer,
        host=settings.relay.host,
        port=settings.relay.port,
        database=database,
        verify=verify,
        allow_anonymous=relay.allow_anonymous,
        settings=dict(relay.tunables),
        tls_cert=None if tls is None else tls.cert,
        tls_key=None if tls is None else tls.key,
    )
    server = await trio.to_thread.run_sync(start)
    if handle is not None:
        handle.attach(server)
    async with trio.open_nursery() as verifications:
        if verifier is not None:
            limit = settings.api.auth_failure_rate_limit
            limiter = AuthFailureLimiter(limit) if limit else None
            verifications.start_soon(_serve_verifications, verifier, limiter, requests_out)
        try:
            async with trio.open_nursery() as nursery:
                if verifier is not None:
                    nursery.start_soon(
                        _revocation_checks, server, verifier, relay.revocation_check_seconds
                    )
                scheme = "grpc" if tls is None else "https"
                task_status.started(f"{scheme}://{Address(settings.relay.host, server.port)}")
                await shutdown.wait()
                nursery.cancel_scope.cancel()
        finally:
            # Shielded: the drain runs to its end (bounded by the graceful timeout); token
            # checks of calls still in flight are answered meanwhile.
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(server.shutdown)
            verifications.cancel_scope.cancel()
