# static._native.relay (crates/python/src/relay.rs, logging.rs): the relay's data plane, its
# settings table, its TLS file check, and its log records into Python's logging.
import os
from collections.abc import Callable, Mapping
from typing import final

@final
class RelayServer:
    """The relay's data plane (Rust), listening once constructed; ``shutdown()`` stops it.

    ``verify(token, peer)`` is called from a thread of the relay's runtime, once per call
    carrying a token, with the caller's ``ip:port``: it returns ``(account_id, key_id,
    expires_at)`` (Unix seconds, or None; one the clock cannot hold, negative or not finite is
    None too), or refuses with ``(code, message)``, code 16 (UNAUTHENTICATED) or 14
    (UNAVAILABLE), or with ``(8, message, retry_after_seconds)`` (RESOURCE_EXHAUSTED, with the
    relay's retry-after trailer). ``database`` is a
    SQLite file or a ``postgresql://`` URL (several relays may share one PostgreSQL database).
    ``settings`` sets tunable settings by name (see :func:`relay_settings`), the others keep
    their defaults. Construction raises ``OSError`` when the relay cannot start (address in use,
    database unreachable or without the relay's tables), ``ValueError`` for a setting unknown or
    out of its bounds, or a TLS certificate or key that cannot serve (``tls_cert`` and
    ``tls_key``: PEM files, both or neither; with them the port serves TLS only).
    """

    def __init__(
        self,
        *,
        host: str,
        port: int,
        database: str,
        # A principal `(account_id, key_id, expires_at, channels)` (channels: the key's channel
        # patterns, None for every channel; the 3-tuple: none), or a refusal.
        verify: Callable[
            [str, str],
            tuple[str, str, float | None, list[str] | None]
            | tuple[str, str, float | None]
            | tuple[int, str]
            | tuple[int, str, int],
        ]
        | None,
        allow_anonymous: bool,
        settings: Mapping[str, float],
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
    ) -> None: ...
    @property
    def port(self) -> int: ...
    def live_keys(self) -> list[str]:
        """The API keys behind live streams."""
    def end_streams_of_key(self, key_id: str, reason: str) -> int:
        """End the live streams of ``key_id`` with UNAUTHENTICATED ``reason``; how many."""
    def bound_keys(self, after: str, limit: int) -> list[str]:
        """Up to ``limit`` distinct API keys behind bound leaves, in order, after ``after``.
        Blocks (call it from a thread); OSError when the store cannot be read."""
    def account_channels(
        self, account: str, patterns: list[str] | None, after: int, limit: int
    ) -> (
        tuple[
            list[
                tuple[
                    str,
                    int,
                    int,
                    int | None,
                    tuple[int | None, int | None, int | None],
                    int,
                    list[tuple[int, bytes, str | None]],
                ]
            ],
            int | None,
        ]
        | None
    ):
        """A page of ``account``'s channels (those with a leaf bound to it), read after channel
        id ``after``, at most ``limit`` (capped at 50), those matching ``patterns`` (None: all):
        ``(channels, next_after)``, each ``(name, epoch, head_seq, last_activity_ms,
        (max_age_seconds, max_entries, max_bytes), member_count, members)`` with at most 100
        ``(leaf_index, identity, account or None)``. Blocks (call it from a thread); None once
        stopped; OSError when the store cannot be read, ValueError for a pattern that does not
        parse."""
    def account_rate(
        self, account: str, patterns: list[str] | None, now_ms: int
    ) -> list[int] | None:
        """How many application messages ``account`` published in each of the 60 minutes
        before ``now_ms`` (Unix ms), the oldest first, in channels matching ``patterns`` (None:
        all). Blocks (call it from a thread); None once stopped; OSError when the store cannot
        be read, ValueError for a pattern that does not parse."""
    def remove_leaves_of_keys(
        self, keys: list[str], max_proposals: int
    ) -> tuple[int, int, int, int]:
        """Propose the removal of every leaf last bound by one of ``keys`` (found inactive),
        at most ``max_proposals``: (proposed, already proposed, skipped, failed). Blocks (call
        it from a thread); OSError when the store cannot be read."""
    def health(self) -> str | None:
        """None while the relay serves and its store can write (its gRPC health status is
        SERVING), else why not (a store write probe failed, draining, stopped)."""
    def metrics(self) -> str:
        """The relay's metrics in Prometheus's text format."""
    def shutdown(self) -> None:
        """Stop accepting, end subscriptions (UNAVAILABLE), let in-flight calls finish within
        the graceful timeout, close connections and the log. Blocks; a second call is a no-op."""

def init_logging(level: int) -> None:
    """Send the relay's log records at ``level`` (a :mod:`logging` level number) and above to
    Python's :mod:`logging` (loggers ``static.relay``, ``static.relay.access``); again to move
    the level."""

def check_tls_files(cert: str | os.PathLike[str], key: str | os.PathLike[str]) -> None:
    """``ValueError`` naming the file at fault unless the PEM certificate chain ``cert`` and the
    private key ``key`` can serve TLS on the relay's port (as :class:`RelayServer` loads them)."""

def relay_settings() -> list[tuple[str, str, str, float, float, float, str]]:
    """The relay's tunable settings, its one table: ``(name, flag, kind, default, low, high,
    help)`` each, kind ``"count"``, ``"real"`` or ``"seconds"``, high ``inf`` for no bound."""
