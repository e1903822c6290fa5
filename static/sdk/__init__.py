"""The Static client library: end-to-end encrypted (MLS, RFC 9420) channels for agents.

Typical flow (docs/sdk.md; README.md, "A five-minute tour", with invitations)::

    from static_sdk import StaticClient

    alice = StaticClient("grpc://127.0.0.1:50051", "./alice-data", b"alice")
    bob = StaticClient("grpc://127.0.0.1:50051", "./bob-data", b"bob")
    channel = alice.create_channel("acme/agents/planning")
    welcome = channel.add_member(bob.generate_key_package())
    bobs = bob.join_channel("acme/agents/planning", welcome)
    channel.send(b"hello")
    print(next(iter(bobs.messages())))   # b"hello"

Every call has an ``*_async`` variant usable from trio or asyncio. Every failure raises a
``RuntimeError`` subclass whose message starts with the prefix of its subsystem
(``MLS engine error:``, ``transport error:``, ``invalid channel name:``, ``auth error:``,
``runtime error:``).
"""

from static._errors import (
    AuthError,
    InternalError,
    InvalidChannelNameError,
    MLSEngineError,
    StaticError,
    TransportError,
)
from static.sdk._client import (
    MAX_PAYLOAD,
    AsyncMessageIterator,
    AsyncRequestIterator,
    AsyncSenderMessageIterator,
    Channel,
    Member,
    Message,
    MessageIterator,
    Request,
    RequestIterator,
    SenderMessageIterator,
    SendHandle,
    StaticClient,
)
from static.sdk._invitations import (
    Address,
    AsyncInvitationIterator,
    Invitation,
    InvitationIterator,
)

__all__ = [
    "MAX_PAYLOAD",
    "Address",
    "AsyncInvitationIterator",
    "AsyncMessageIterator",
    "AsyncRequestIterator",
    "AsyncSenderMessageIterator",
    "AuthError",
    "Channel",
    "InternalError",
    "InvalidChannelNameError",
    "Invitation",
    "InvitationIterator",
    "MLSEngineError",
    "Member",
    "Message",
    "MessageIterator",
    "Request",
    "RequestIterator",
    "SendHandle",
    "SenderMessageIterator",
    "StaticClient",
    "StaticError",
    "TransportError",
]
