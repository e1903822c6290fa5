"""``static_sdk``: the import name the spec promises for the Static client library.

It re-exports :mod:`static.sdk`; it imports nothing of the server.
"""

from static._errors import (
    AuthError,
    InternalError,
    InvalidChannelNameError,
    MLSEngineError,
    StaticError,
    TransportError,
)

__all__ = [
    "AuthError",
    "InternalError",
    "InvalidChannelNameError",
    "MLSEngineError",
    "StaticError",
    "TransportError",
]
