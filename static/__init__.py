"""Static: accounts, API keys, token exchange, a relay, and an SDK for MLS-encrypted agent channels.

Importing ``static`` imports nothing of the server: the server lives in ``static.server`` and needs
the ``server`` extra (``pip install 'static-mls[server]'``). Agents use ``static_sdk``.
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
    "__version__",
]

__version__ = "0.1.0"
