"""``static_sdk``: the import name the spec promises for the Static client library.

It re-exports :mod:`static.sdk` (``StaticClient``, ``Channel``, the message iterators and the
error classes); it imports nothing of the server.
"""

from static.sdk import (
    MAX_PAYLOAD,
    Address,
    AsyncInvitationIterator,
    AsyncMessageIterator,
    AsyncRequestIterator,
    AsyncSenderMessageIterator,
    AuthError,
    Channel,
    InternalError,
    InvalidChannelNameError,
    Invitation,
    InvitationIterator,
    Member,
    Message,
    MessageIterator,
    MLSEngineError,
    Request,
    RequestIterator,
    SenderMessageIterator,
    SendHandle,
    StaticClient,
    StaticError,
    TransportError,
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
