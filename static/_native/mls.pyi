# static._native.mls (crates/python/src/mls.rs): the MLS engine, what it made of a message, and
# the channel-name rule.
#
# Every method releases the GIL and is safe to call from several threads at once. Failures raise
# the classes of static._errors: MLSEngineError ("MLS engine error: ..."), InvalidChannelNameError
# ("invalid channel name: ..."), InternalError ("runtime error: ..."); all subclass RuntimeError.
# Every bytes value on the wire is a TLS-serialized RFC 9420 MLSMessage.
import os
from types import TracebackType
from typing import Final, Literal, final

CIPHERSUITE: Final[str]
PAST_EPOCHS: Final[int]

IncomingKind = Literal[
    "application",
    "commit",
    "own_commit",
    "removed",
    "proposal",
    "own",
    "request",
    "reply",
    "unrecognized",
]

def validate_channel_name(name: str) -> None: ...

#: The channel-name rule's limits and wording (static-mls), shared by the SDK and both relays.
MAX_CHANNEL_NAME_LENGTH: Final[int]
CHANNEL_NAME_FORM: Final[str]

@final
class Incoming:
    """What Engine.process_incoming did with one message of the channel's log.

    application: another member's message (sender, payload, epoch); commit: another member's
    commit, merged (sender, epoch = new epoch); own_commit: our pending commit echoed, merged;
    removed: a commit removed us, the group is deleted locally; proposal: stored until a commit
    covers it (sender); own: our own message echoed, skipped; request / reply: another
    member's request or reply (sender, payload = its body, epoch; see docs/sdk.md, Request and
    reply); unrecognized: an application message of a kind this version does not know (sender),
    dropped.
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
