"""``serve_relay``: the relay of ``static serve``, the Rust data plane (``static._native.relay``'s
``RelayServer``) driven from trio.

The gRPC service, the channel logs and their group-committing writer run on a tokio runtime of
the extension, in this process, on the same database as the HTTP API (the SQLite file, or a
PostgreSQL database that other ``static serve`` processes may share); no message crosses into
Python. What stays here is what is not per message: the token checks
(:mod:`static.relay._verify`), the re-check of the keys behind live streams for revocation every
``revocation_check_seconds``, and shutdown.
"""

from __future__ import annotations

import math
from functools import partial

import trio

from static._native.relay import RelayServer
from static._settings import Address, ServerSettings
from static.api import AuthFailureLimiter
from static.auth import TokenVerifier
from static.relay._handle import RelayHandle
from static.relay._verify import Request, serve_verifications, verify_from_threads
from static.store import DatabaseError, relay_database

__all__ = ["serve_relay"]


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


async def serve_relay(
    settings: ServerSettings,
    verifier: TokenVerifier | None,
    shutdown: trio.Event,
    *,
    handle: RelayHandle | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the relay on ``settings.relay`` over the (already migrated) database of ``settings``
    (the SQLite file or the PostgreSQL database) until ``shutdown`` is set; report
    ``grpc://HOST:PORT`` (``https://HOST:PORT`` with ``settings.tls``: the relay terminates TLS
    itself, rustls) through ``task_status`` once it listens; ``handle`` then reads its health and
    metrics.

    Binds only the configured host, without SO_REUSEPORT. On shutdown: stop accepting, end live
    subscriptions (UNAVAILABLE), let in-flight calls finish within the graceful timeout, close
    every connection, commit what was submitted.
    """
    database = relay_database(settings.resolved_database_url)
    relay = settings.relay_settings
    tls = settings.tls
    requests_in, requests_out = trio.open_memory_channel[Request](math.inf)
    verify = (
        None
        if verifier is None
        else verify_from_threads(requests_in, trio.lowlevel.current_trio_token())
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
            verifications.start_soon(serve_verifications, verifier, limiter, requests_out)
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
