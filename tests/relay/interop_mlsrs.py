"""mls-rs (an RFC 9420 implementation independent of the SDK's OpenMLS, through its UniFFI
binding ``mls_rs_uniffi``) as a channel member that talks to the relay over raw gRPC.

:class:`MlsRsMember` joins from a Welcome, publishes what mls-rs makes (application messages,
commits, proposals) with :class:`tests.relay.client.Relay`, and reads the channel's log with a
raw Subscribe, processing each entry in mls-rs (its own entries skipped: they are applied when
the relay accepts them). The binding is untyped; this module is its typed face for the tests.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any

import mls_rs_uniffi as mls  # type: ignore[import-untyped]

from tests.relay.client import Relay, Subscription, pb

__all__ = [
    "APPLICATION",
    "COMMIT",
    "KEY_PACKAGE",
    "PRIVATE_MESSAGE",
    "PROPOSAL",
    "PUBLIC_MESSAGE",
    "WELCOME",
    "MlsRsMember",
    "Received",
    "outsider_commit",
    "wire_format",
]

#: RFC 9420 §6 WireFormat values (the second u16 of an MLSMessage, after the version).
PUBLIC_MESSAGE, PRIVATE_MESSAGE, WELCOME, GROUP_INFO, KEY_PACKAGE = 1, 2, 3, 4, 5
#: The relay's Entry.content_type values.
APPLICATION, PROPOSAL, COMMIT = 1, 2, 3

WAIT = 10.0


def wire_format(message: bytes) -> int:
    """The wire format of a TLS-serialized MLSMessage (its version must be mls10)."""
    version, wire = struct.unpack(">HH", message[:4])
    assert version == 1, f"not an MLS 1.0 message: version {version}"
    return int(wire)


@dataclass(frozen=True)
class Received:
    """What mls-rs made of one entry of the log."""

    seq: int
    #: "application", "commit" or "proposal".
    kind: str
    #: The sender's (the committer's) mls-rs SigningIdentity: compare with ``==``.
    sender: Any
    #: An application message's plaintext.
    data: bytes = b""
    #: How many proposals a commit applied.
    applied: int = 0


class MlsRsMember:
    """One mls-rs client (basic credential ``identity``, cipher suite 1) and, once joined, its
    group on one channel."""

    def __init__(self, identity: bytes, relay: Relay) -> None:
        self.identity = identity
        self.relay = relay
        keys = mls.generate_signature_keypair(mls.CipherSuite.CURVE25519_AES128)
        # In-memory group state; the ratchet tree goes in the Welcomes it makes (as the SDK's).
        self.client: Any = mls.Client(identity, keys, mls.client_config_default())
        self.group: Any = None
        self.channel = ""
        self.subscription: Subscription | None = None
        #: Seqs of what we published: never processed from the log again.
        self.own: set[int] = set()
        self._next = 0

    @property
    def signing_identity(self) -> Any:
        return self.client.signing_identity()

    def key_package(self) -> bytes:
        """A fresh KeyPackage, as an MLSMessage."""
        return bytes(self.client.generate_key_package_message().to_bytes())

    def join(self, channel: str, welcome: bytes) -> int:
        """Join from ``welcome`` (ratchet tree in it) and follow the log from the epoch the
        relay says the Welcome starts at (FetchWelcome); that epoch."""
        fetched = self.relay.stub.FetchWelcome(
            pb.FetchWelcomeRequest(
                channel=channel, welcome_sha256=hashlib.sha256(welcome).digest()
            ),
            timeout=WAIT,
            metadata=self.relay.metadata,
        )
        assert fetched.welcome == welcome
        self.group = self.client.join_group(None, mls.Message.from_bytes(welcome)).group
        self.channel = channel
        self.subscription = self.relay.subscribe(channel, from_epoch=fetched.epoch)
        return int(fetched.epoch)

    # --- what mls-rs makes, unpublished ------------------------------------------------------

    def encrypt(self, payload: bytes) -> bytes:
        return bytes(self.group.encrypt_application_message(payload).to_bytes())

    def commit(self) -> bytes:
        """An empty commit (with a path: a key update), pending until :meth:`publish_commit`."""
        return bytes(self.group.commit().commit_message.to_bytes())

    def add(self, key_package: bytes) -> tuple[bytes, bytes]:
        """A commit adding the owner of ``key_package``: (commit, Welcome), pending."""
        out = self.group.add_members([mls.Message.from_bytes(key_package)])
        return bytes(out.commit_message.to_bytes()), bytes(out.welcome_message.to_bytes())

    def propose_remove(self, member: Any) -> bytes:
        """A Remove proposal of ``member`` (a SigningIdentity from a :class:`Received`)."""
        (proposal,) = self.group.propose_remove_members([member])
        return bytes(proposal.to_bytes())

    # --- publishing ----------------------------------------------------------------------------

    def publish(self, message: bytes) -> Any:
        """Publish an application message or proposal: the PublishResponse."""
        response = self.relay.publish(self.channel, message)
        self.own.add(response.seq)
        return response

    def send(self, payload: bytes) -> Any:
        return self.publish(self.encrypt(payload))

    def publish_commit(self, commit: bytes, welcome: bytes = b"") -> Any:
        """Publish our pending ``commit`` (with its Welcome, if any) and, once the relay took
        it, apply it here: the PublishResponse."""
        response = self.relay.publish(self.channel, commit, welcome=welcome)
        self.own.add(response.seq)
        applied = self.group.process_incoming_message(mls.Message.from_bytes(commit))
        assert applied.is_commit(), applied
        return response

    # --- reading -------------------------------------------------------------------------------

    def receive(self, timeout: float = WAIT) -> Received:
        """Process the next entry of the log that another member published."""
        assert self.subscription is not None, "join first"
        while True:
            entry = self.subscription.wait_for(self._next + 1, timeout)[self._next]
            self._next += 1
            if entry.seq not in self.own:
                return self._process(entry)

    def entries(self) -> list[Any]:
        """The log's entries read so far (pb.Entry), ours included."""
        assert self.subscription is not None, "join first"
        return list(self.subscription.entries)

    def _process(self, entry: Any) -> Received:
        out = self.group.process_incoming_message(mls.Message.from_bytes(entry.message))
        seq = int(entry.seq)
        if out.is_application_message():
            return Received(seq, "application", out.sender, data=bytes(out.data))
        if out.is_commit():
            assert out.effect.is_new_epoch(), out.effect
            applied = len(out.effect.applied_proposals)
            return Received(seq, "commit", out.committer, applied=applied)
        if out.is_received_proposal():
            return Received(seq, "proposal", out.sender)
        raise AssertionError(f"unexpected entry {seq} for mls-rs: {out}")

    def close(self) -> None:
        if self.subscription is not None:
            self.subscription.cancel()


def outsider_commit(channel: str, identity: bytes, epoch: int) -> bytes:
    """A commit at ``epoch`` for a group with ``channel``'s id that an outsider made on its own
    (its leaf 0, a signature key the channel's group does not have): signed, well formed, and
    not a member's."""
    client = mls.Client(
        identity,
        mls.generate_signature_keypair(mls.CipherSuite.CURVE25519_AES128),
        mls.client_config_default(),
    )
    group = client.create_group(channel.encode())
    for _ in range(epoch):
        group.process_incoming_message(group.commit().commit_message)
    return bytes(group.commit().commit_message.to_bytes())
