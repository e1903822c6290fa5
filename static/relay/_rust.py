"""``serve_rust_relay``: the relay's data plane in Rust (``static._native.RelayServer``).

The gRPC service, the channel logs and their group-committing writer run on a tokio runtime of
the extension, in this process, on the same database as the HTTP API (the SQLite file, or the
PostgreSQL database, which the extension connects to itself); no message crosses into Python.
What stays here is what is not per message: tokens are checked by the server's
:class:`~static.auth.TokenVerifier` once per call (the extension calls ``verify`` from one of its
threads, which waits for the trio thread), the keys behind live streams are re-checked for
revocation every ``revocation_check_seconds``, and shutdown is decided here.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import trio

from static._native import RelayServer
from static._settings import Address, ServerSettings
from static.auth import TokenVerifier
from static.auth import Unauthenticated as TokenRefused
from static.store import DatabaseError

__all__ = ["serve_rust_relay"]

#: gRPC codes ``verify`` refuses with.
_UNAVAILABLE = 14
_UNAUTHENTICATED = 16

_Verified = tuple[str, str, float | None] | tuple[int, str]


def _verify_in_trio(
    verifier: TokenVerifier, trio_token: trio.lowlevel.TrioToken
) -> Callable[[str], _Verified]:
    """``verify(token)`` for the extension's threads: the principal, or a (code, text)
    refusal."""

    def verify(token: str) -> _Verified:
        try:
            principal = trio.from_thread.run(verifier.verify_token, token, trio_token=trio_token)
        except TokenRefused as exc:
            return (_UNAUTHENTICATED, str(exc) or "invalid token")
        except DatabaseError as exc:
            return (_UNAVAILABLE, f"store unavailable: {exc}")
        except trio.RunFinishedError:
            return (_UNAVAILABLE, "relay is shutting down")
        return (principal.account_id, principal.key_id, principal.expires_at)

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
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the relay on ``settings.relay`` over ``database`` (already migrated: a SQLite file's
    path, or the ``postgresql://`` URL the store connected with) until ``shutdown`` is set;
    report ``grpc://HOST:PORT``.

    Binds only the configured host, without SO_REUSEPORT. On shutdown: stop accepting, end live
    subscriptions (UNAVAILABLE), let in-flight calls finish within the graceful timeout, close
    every connection, commit what was submitted.
    """
    relay = settings.relay_settings
    verify = (
        None if verifier is None else _verify_in_trio(verifier, trio.lowlevel.current_trio_token())
    )
    start = partial(
        RelayServer,
        host=settings.relay.host,
        port=settings.relay.port,
        database=database,
        verify=verify,
        allow_anonymous=relay.allow_anonymous,
        max_message_bytes=relay.max_message_bytes,
        graceful_timeout=relay.graceful_timeout_seconds,
        application_window=relay.application_epoch_window,
        keepalive_interval=relay.keepalive_interval_seconds,
        max_streams_per_connection=relay.max_streams_per_connection,
        reset_burst=relay.reset_burst,
        reset_rate_per_second=relay.reset_rate_per_second,
        publish_rate_per_agent=relay.publish_rate_per_agent,
    )
    server = await trio.to_thread.run_sync(start)
    try:
        async with trio.open_nursery() as nursery:
            if verifier is not None:
                nursery.start_soon(
                    _revocation_checks, server, verifier, relay.revocation_check_seconds
                )
            task_status.started(f"grpc://{Address(settings.relay.host, server.port)}")
            await shutdown.wait()
            nursery.cancel_scope.cancel()
    finally:
        # Shielded: the drain runs to its end (bounded by the graceful timeout); the trio thread
        # stays free meanwhile for the token checks of calls still in flight.
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(server.shutdown)
