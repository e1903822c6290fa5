"""The client-side error hierarchy: one class per row of the error table (docs/sdk.md, Errors).

Every class subclasses ``RuntimeError`` (the spec says all methods raise RuntimeError) and every
message begins with the class's prefix. These classes are defined here once; the native extension
imports and raises them, so Python and Rust failures look the same to a caller.
"""

from typing import ClassVar

__all__ = [
    "AuthError",
    "InternalError",
    "InvalidChannelNameError",
    "MLSEngineError",
    "StaticError",
    "TransportError",
]


class StaticError(RuntimeError):
    """Base of every error the SDK raises. ``str(err)`` begins with :attr:`prefix`."""

    prefix: ClassVar[str] = "runtime error:"

    def __init__(self, detail: str = "") -> None:
        # Accept an already-prefixed message so re-raising never doubles the prefix.
        message = detail if detail.startswith(self.prefix) else f"{self.prefix} {detail}".rstrip()
        super().__init__(message)

    @property
    def detail(self) -> str:
        """The message without its prefix."""
        return str(self)[len(self.prefix) :].lstrip()


class MLSEngineError(StaticError):
    """MLS protocol failure: bad key package, invalid Welcome, decryption error."""

    prefix = "MLS engine error:"


class TransportError(StaticError):
    """Network failure: relay unreachable, gRPC connection error."""

    prefix = "transport error:"


class InvalidChannelNameError(StaticError, ValueError):
    """A channel name that is not of the form ``org/namespace/service``."""

    prefix = "invalid channel name:"


class AuthError(StaticError):
    """The API key is invalid, revoked or expired, or a token was refused."""

    prefix = "auth error:"


class InternalError(StaticError):
    """An internal library error."""

    prefix = "runtime error:"
