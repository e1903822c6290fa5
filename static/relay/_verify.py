"""The relay's token checks: the extension asks from its own threads, a trio task answers.

Tokens are checked by the server's :class:`~static.auth.TokenVerifier` once per call, behind the
HTTP port's limit on failed authentications per client address
(:class:`~static.api.AuthFailureLimiter`, with a budget of its own).

The checks are answered by a task of the serving nursery rather than by
``trio.from_thread.run``: a task started from a foreign thread would lack that task's context,
which the PostgreSQL store (triopg, over trio-asyncio) needs.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import trio

from static import _metrics
from static.api import AuthAttempt, AuthFailureLimiter, client_key
from static.auth import INVALID_TOKEN, TokenVerifier
from static.auth import Unauthenticated as TokenRefused
from static.store import DatabaseError

__all__ = ["Request", "serve_verifications", "verify_from_threads"]

#: gRPC codes ``verify`` refuses with.
_RESOURCE_EXHAUSTED = 8
_UNAVAILABLE = 14
_UNAUTHENTICATED = 16

#: A principal ``(account_id, key_id, expires_at, channels)`` (``channels``: the key's channel
#: patterns, None for every channel; the relay enforces them), a refusal ``(code, text)``, or
#: ``(RESOURCE_EXHAUSTED, text, retry after s)``.
_Verified = tuple[str, str, float | None, list[str] | None] | tuple[int, str] | tuple[int, str, int]
_SHUTTING_DOWN: _Verified = (_UNAVAILABLE, "relay is shutting down")

_log = logging.getLogger("static.auth")


@dataclass(frozen=True)
class Request:
    """One token check the extension asked for, and the future its thread waits on."""

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
        # `channels` is read with a default: a principal of before issue 30 has none.
        channels = getattr(principal, "channels", None)
        return (
            principal.account_id,
            principal.key_id,
            principal.expires_at,
            None if channels is None else list(channels),
        )
    if attempt is not None:
        attempt.failed(time.monotonic())
    return refusal


def _token_result(answer: _Verified) -> str:
    """The token check's result, for its metric."""
    if isinstance(answer[0], str):  # a principal: (account_id, key_id, expires_at, channels)
        return "ok"
    if answer[0] == _UNAVAILABLE:
        return "store_unavailable"
    if answer[0] == _RESOURCE_EXHAUSTED:
        return "rate_limited"
    return "invalid_token"


async def _answer(
    verifier: TokenVerifier, limiter: AuthFailureLimiter | None, request: Request
) -> None:
    answer = _SHUTTING_DOWN
    try:
        answer = await _check(verifier, request.token, request.peer, limiter)
        _metrics.token_check("relay", _token_result(answer))
    finally:
        # Cancelled (shutdown) too: the extension's thread waits for an answer.
        request.answer.set_result(answer)


async def serve_verifications(
    verifier: TokenVerifier,
    limiter: AuthFailureLimiter | None,
    requests: trio.MemoryReceiveChannel[Request],
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


def verify_from_threads(
    requests: trio.MemorySendChannel[Request], trio_token: trio.lowlevel.TrioToken
) -> Callable[[str, str], _Verified]:
    """``verify(token, peer)`` for the extension's threads: hands the token to
    :func:`serve_verifications` and waits for its answer."""

    def verify(token: str, peer: str) -> _Verified:
        request = Request(token, peer, Future())
        try:
            trio.from_thread.run_sync(requests.send_nowait, request, trio_token=trio_token)
        except (trio.RunFinishedError, trio.BrokenResourceError, trio.ClosedResourceError):
            return _SHUTTING_DOWN
        return request.answer.result()

    return verify
