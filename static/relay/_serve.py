"""``serve_relay``: the relay of ``static serve``, the Rust data plane (``static._native.relay``'s
``RelayServer``) driven from trio.

The gRPC service, the channel logs and their group-committing writer run on a tokio runtime of
the extension, in this process, on the same database as the HTTP API (the SQLite file, or a
PostgreSQL database that other ``static serve`` processes may share); no message crosses into
Python. What stays here is what is not per message: the token checks
(:mod:`static.relay._verify`), the re-check of the keys behind live streams for revocation every
``revocation_check_seconds``, the removal of the leaves of inactive keys from their channels every
``removal_check_seconds`` (and at once on a revocation), and shutdown.
"""

from __future__ import annotations

import contextlib
import logging
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

_log = logging.getLogger("static.relay")


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


#: Keys checked per batch of a removal pass.
_KEYS_PER_BATCH = 500
#: Remove proposals the relay appends per batch of keys (the rest wait for the next pass).
_PROPOSALS_PER_BATCH = 1_000


async def _removal_pass(server: RelayServer, verifier: TokenVerifier) -> int:
    """One pass: the keys behind bound leaves in batches, the inactive ones' leaves proposed
    for removal (the relay is an external sender of each channel that names it); how many
    proposals were appended."""
    proposed = 0
    after = ""
    while True:
        keys = await trio.to_thread.run_sync(server.bound_keys, after, _KEYS_PER_BATCH)
        if not keys:
            return proposed
        # One query for the batch: revoked, expired, or past a roll's grace.
        inactive = await verifier.inactive_keys(keys)
        if inactive:
            report = await trio.to_thread.run_sync(
                server.remove_leaves_of_keys, sorted(inactive), _PROPOSALS_PER_BATCH
            )
            proposed += report[0]
        if len(keys) < _KEYS_PER_BATCH:
            return proposed
        after = keys[-1]


def _listen_for_revocations(verifier: TokenVerifier, wake: trio.MemorySendChannel[None]) -> None:
    """Wake the removal pass as soon as the authority revokes a key (when it can tell:
    ``add_revocation_listener``). The listener never blocks its caller, on any thread."""
    add_listener = getattr(verifier, "add_revocation_listener", None)
    if add_listener is None:
        return
    token = trio.lowlevel.current_trio_token()

    def poke() -> None:
        # A pass is due already, or the relay stopped.
        with contextlib.suppress(trio.WouldBlock, trio.ClosedResourceError):
            wake.send_nowait(None)

    def revoked(key_id: str) -> None:
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(poke)

    add_listener(revoked)


async def _removal_checks(server: RelayServer, verifier: TokenVerifier, every: float) -> None:
    """Propose the removal of the leaves whose binding's key is no longer active, every
    ``every`` seconds and at once when a revocation is heard of (docs/design.md §5.2)."""
    wake_in, wake_out = trio.open_memory_channel[None](1)
    _listen_for_revocations(verifier, wake_in)
    while True:
        with trio.move_on_after(every):
            await wake_out.receive()
        try:
            await _removal_pass(server, verifier)
        except (DatabaseError, OSError):
            continue  # A store hiccup must not end the checks: try again next round.
        except Exception:  # noqa: BLE001  (a failed pass must not end the server; one line a pass)
            _log.exception("the removal pass failed; it runs again in %s s", every)


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
                    nursery.start_soon(
                        _removal_checks, server, verifier, relay.removal_check_seconds
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
