# Hand-written stub for the extension module built from crates/python (crate static-native).
#
# Every method releases the GIL and is safe to call from several threads at once. Failures raise
# the classes of static._errors: MLSEngineError ("MLS engine error: ..."), InvalidChannelNameError
# ("invalid channel name: ..."), InternalError ("runtime error: ..."); all subclass RuntimeError.
# Every bytes value on the wire is a TLS-serialized RFC 9420 MLSMessage.
import os
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Final, Literal, final, overload

__version__: str
CIPHERSUITE: Final[str]
PAST_EPOCHS: Final[int]

IncomingKind = Literal["application", "commit", "own_commit", "removed", "proposal", "own"]
#: A received message with its metadata: (payload, sender identity, publishing account as the
#: relay attests it or None when unknown, seq, epoch).
MessageFields = tuple[bytes, bytes, str | None, int, int]

def validate_channel_name(name: str) -> None: ...

#: The channel-name rule's limits and wording (static-mls), shared by the SDK and both relays.
MAX_CHANNEL_NAME_LENGTH: Final[int]
CHANNEL_NAME_FORM: Final[str]

# Registered with atexit on import: from then on, threads coming back from a blocking call park
# instead of taking the GIL during finalization (which would abort the process on 3.11-3.13).
def _at_exit() -> None: ...

# Benchmark support (bench/mls_core.py); not part of the SDK surface.
def _synthetic_key_packages(n: int) -> list[bytes]: ...
def _bench_rust_encrypt_decrypt(
    sender: Engine, receiver: Engine, channel: str, payload_len: int, iterations: int
) -> tuple[float, float]: ...
def _bench_ed25519_sign_verify_ns(payload_len: int, iterations: int) -> float: ...

@final
class Incoming:
    """What Engine.process_incoming did with one message of the channel's log.

    application: another member's message (sender, payload, epoch); commit: another member's
    commit, merged (sender, epoch = new epoch); own_commit: our pending commit echoed, merged;
    removed: a commit removed us, the group is deleted locally; proposal: stored until a commit
    covers it (sender); own: our own message echoed, skipped.
    """

    @property
    def kind(self) -> IncomingKind: ...
    @property
    def sender(self) -> bytes | None: ...
    @property
    def payload(self) -> bytes | None: ...
    @property
    def epoch(self) -> int | None: ...

@final
class Engine:
    """One MLS client (identity + groups) persisted crash-safely under ``data_dir``.

    The directory is locked while the engine is open; a second opener gets InternalError.
    """

    def __init__(self, data_dir: str | os.PathLike[str], identity: bytes) -> None: ...
    @property
    def identity(self) -> bytes: ...
    @property
    def signature_public_key(self) -> bytes: ...
    @property
    def data_dir(self) -> str: ...
    def close(self) -> None: ...
    def __enter__(self) -> Engine: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...
    def groups(self) -> list[str]: ...
    def has_group(self, channel: str) -> bool: ...
    def generate_key_package(self) -> bytes: ...
    def create_group(self, channel: str) -> None: ...
    def join_group(self, channel: str, welcome: bytes) -> None: ...
    def add_member(self, channel: str, key_package: bytes) -> tuple[bytes, bytes]:
        """Returns (pending commit, Welcome)."""
    def add_members(self, channel: str, key_packages: list[bytes]) -> tuple[bytes, bytes]:
        """Adds several members in one commit; returns (pending commit, Welcome)."""
    def self_update(self, channel: str) -> bytes: ...
    def remove_member(self, channel: str, identity: bytes) -> bytes: ...
    def leave(self, channel: str) -> bytes: ...
    def commit_pending_proposals(self, channel: str) -> bytes | None: ...
    def merge_pending_commit(self, channel: str) -> int: ...
    def clear_pending_commit(self, channel: str) -> None: ...
    def pending_commit(self, channel: str) -> bytes | None: ...
    def has_pending_commit(self, channel: str) -> bool: ...
    def encrypt(self, channel: str, payload: bytes) -> bytes: ...
    def process_incoming(self, channel: str, message: bytes) -> Incoming: ...
    def members(self, channel: str) -> list[tuple[int, bytes]]: ...
    def epoch(self, channel: str) -> int: ...
    def epoch_authenticator(self, channel: str) -> bytes: ...
    def public_state(self, channel: str) -> tuple[bytes, bytes]:
        """Returns (group_info, ratchet_tree), each TLS-serialized: the channel's public state
        at its current epoch, from which the relay validates handshakes."""
    def leaf_binding(self, channel: str, account: str) -> tuple[int, bytes]:
        """Returns (leaf_index, signature): our leaf's proof, for the relay, that it acts for
        ``account``; renew it after a commit of ours changes our leaf's keys."""

# --- the SDK client (static.sdk wraps these; use static_sdk.StaticClient) -------------------

MAX_PAYLOAD: Final[int]

@final
class Client:
    """Engine + relay transport on a tokio runtime of its own; see static.sdk.StaticClient.

    ``token_provider`` returns ``(token, expires_in_seconds)``; what it raises keeps its prefix
    (``auth error:`` is final, anything else is retried). Transport failures raise
    TransportError ("transport error: ..."), refused credentials AuthError ("auth error: ...").
    """

    def __init__(
        self,
        endpoint: str,
        data_dir: str | os.PathLike[str],
        identity: bytes,
        token_provider: Callable[[], tuple[str, float]] | None = None,
        initial_token: tuple[str, float] | None = None,
        connect_timeout: float | None = None,
        retry_timeout: float | None = None,
        ca_file: str | os.PathLike[str] | None = None,
    ) -> None:
        """``connect_timeout``: how long calls retry before the relay first answered;
        ``retry_timeout``: how long they retry a relay that answered before (None: the
        environment's ``STATIC_SDK_CONNECT_TIMEOUT`` / ``STATIC_SDK_RETRY_TIMEOUT``, else 1 s and
        30 s). ``ca_file``: PEM CA certificates an ``https://`` relay must chain to (None: the
        system's roots)."""
    @property
    def identity(self) -> bytes: ...
    @property
    def data_dir(self) -> str: ...
    def generate_key_package(self) -> bytes: ...
    def channels(self) -> list[str]: ...
    def create_channel(self, name: str) -> Channel: ...
    def join_channel(self, name: str, welcome: bytes) -> Channel: ...
    def open_channel(self, name: str) -> Channel: ...
    def close(self) -> None: ...

@final
class Channel:
    """One open channel; see static.sdk.Channel. ``poll_next``/``next_message`` return
    ``(0, payload)`` for a message, ``(1, None)`` for nothing (yet), ``(2, None)`` at the end."""

    @property
    def name(self) -> str: ...
    @property
    def closed(self) -> bool: ...
    def progress(self) -> tuple[int, int, int, bool]:
        """(applied_seq, epoch, head_seq, connected)."""
    def timings(self) -> tuple[int, int, int, int, int, int]:
        """When the latest message passed each stage, in ns of the system clock (comparable
        across processes): send started, encrypted, acknowledged by the relay; entries
        received, applied, a message handed out. For benchmarks."""
    def send(self, payload: bytes) -> None: ...
    def send_pipelined(self, payload: bytes, block: bool = True) -> SendHandle | None:
        """Records ``payload`` in the channel's outbox journal and queues it for the
        channel's sender thread; None only when ``block`` is false and the pipeline is full."""
    def pipelined_count(self) -> int:
        """How many messages ``send_pipelined`` ever accepted on this channel (durable)."""
    def flush(self, timeout: float | None = None) -> bool:
        """Waits until every pipelined send so far is settled: True, or False on timeout.
        Raises the first failure among them not reported by an earlier flush."""
    def add_member(self, key_package: bytes) -> bytes: ...
    def remove_member(self, identity: bytes) -> None: ...
    def rotate_keys(self) -> None: ...
    def leave(self) -> None: ...
    def members(self) -> list[bytes]: ...
    def roster(self) -> tuple[int, list[tuple[int, bytes, str | None]]]:
        """The relay's attested members: (epoch, [(leaf_index, identity, account or None)])."""
    def epoch(self) -> int: ...
    def epoch_authenticator(self) -> bytes: ...
    def pending(self) -> int: ...
    @overload
    def poll_next(self, detailed: Literal[False] = False) -> tuple[int, bytes | None]: ...
    @overload
    def poll_next(self, detailed: Literal[True]) -> tuple[int, MessageFields | None]: ...
    @overload
    def next_message(
        self, timeout: float | None = None, detailed: Literal[False] = False
    ) -> tuple[int, bytes | None]: ...
    @overload
    def next_message(
        self, timeout: float | None, detailed: Literal[True]
    ) -> tuple[int, MessageFields | None]: ...
    @overload
    def next_payload(self, detailed: Literal[False] = False) -> bytes | None:
        """The next message (waiting as long as it takes, answering Ctrl-C), None at the end."""
    @overload
    def next_payload(self, detailed: Literal[True]) -> MessageFields | None: ...
    def waker(self) -> Waker: ...
    def close(self) -> None: ...

@final
class SendHandle:
    """One pipelined send."""

    def done(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> bool:
        """True once the message is in the channel's log (raises its failure instead); False
        on timeout."""

@final
class Waker:
    """A socket readable when the channel's inbox may have gained messages."""

    def fileno(self) -> int: ...
    def drain(self) -> None: ...

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
        verify: Callable[
            [str, str],
            tuple[str, str, float | None] | tuple[int, str] | tuple[int, str, int],
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
