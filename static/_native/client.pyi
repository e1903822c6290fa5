# static._native.client (crates/python/src/client.rs): the SDK's native client (static.sdk wraps
# these; use static_sdk.StaticClient).
#
# Every method releases the GIL and is safe to call from several threads at once. Failures raise
# the classes of static._errors: MLSEngineError ("MLS engine error: ..."), InvalidChannelNameError
# ("invalid channel name: ..."), InternalError ("runtime error: ..."); all subclass RuntimeError.
import os
from collections.abc import Callable
from typing import Final, Literal, final, overload

#: A received message with its metadata: (payload, sender identity, publishing account as the
#: relay attests it or None when unknown, seq, epoch).
MessageFields = tuple[bytes, bytes, str | None, int, int]

#: A pending invitation: (id, channel, inviter identity, inviter account, created at unix ms,
#: expires at unix ms).
InvitationFields = tuple[int, str, bytes, str, int, int]
#: A received request: (request id, payload, sender identity, publishing account or None, seq,
#: epoch).
RequestFields = tuple[bytes, bytes, bytes, str | None, int, int]

MAX_PAYLOAD: Final[int]

def parse_address(text: str) -> tuple[str, bytes]:
    """(account, identity) of a printed address; ValueError when it is not one."""

def format_address(account: str, identity: bytes) -> str: ...

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
    def address(self) -> tuple[str, bytes]: ...
    def keep_key_packages(self) -> None: ...
    def allow_invitations(self, accounts: list[str]) -> None: ...
    def list_invitations(self, after_id: int, wait: float = 0.0) -> list[InvitationFields]:
        """Pending invitations after ``after_id``; with none, the relay holds the call up to
        ``wait`` seconds (at most 20) for one to come."""
    def accept_invitation(self, id: int, channel: str) -> Channel: ...
    def decline_invitation(self, id: int) -> None: ...
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
    def invite(self, account: str, identity: bytes) -> None: ...
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
    def request(self, payload: bytes) -> PendingRequest:
        """Sends a request (or takes over the one an earlier call with the same payload left
        waiting for its reply); returns once it is in the log."""
    def reply(self, id: bytes, payload: bytes) -> None:
        """Replies to request ``id`` (blocking until the reply is in the log)."""
    def poll_request(self) -> tuple[int, RequestFields | None]:
        """The next request received, without waiting (codes as ``poll_next``'s)."""
    def next_request(self, timeout: float | None = None) -> tuple[int, RequestFields | None]:
        """The next request received, waiting up to ``timeout`` seconds (forever if None)."""
    def waker(self) -> Waker: ...
    def close(self) -> None: ...

@final
class PendingRequest:
    """A request of ours waiting for its reply; dropping it leaves the request recorded (a
    later ``request`` with the same payload takes it over)."""

    @property
    def id(self) -> bytes: ...
    def poll(self) -> MessageFields | None:
        """The reply if it came (handed out once), else None; raises once the channel ended."""
    def wait(self, timeout: float | None = None) -> MessageFields | None:
        """Waits up to ``timeout`` seconds (forever if None) for the reply; None on timeout."""

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
