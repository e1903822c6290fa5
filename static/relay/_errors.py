"""The relay's one error hierarchy; :mod:`static.relay._service` maps it to gRPC statuses once."""

from __future__ import annotations

import enum

from static._native import CURRENT_EPOCH_TRAILER, RETRY_AFTER_TRAILER

__all__ = [
    "AlreadyExists",
    "Code",
    "InvalidArgument",
    "NotFound",
    "RelayError",
    "ResourceExhausted",
    "StaleEpoch",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
]


class Code(enum.IntEnum):
    """gRPC status codes (the subset the relay uses)."""

    OK = 0
    INVALID_ARGUMENT = 3
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    INTERNAL = 13
    UNAVAILABLE = 14
    UNAUTHENTICATED = 16
    UNIMPLEMENTED = 12


class RelayError(Exception):
    """A refusal with a gRPC status code, a message safe to show, and trailing metadata."""

    code: Code = Code.INTERNAL

    def __init__(self, message: str, trailers: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.trailers = trailers


class InvalidArgument(RelayError):
    code = Code.INVALID_ARGUMENT


class NotFound(RelayError):
    code = Code.NOT_FOUND


class AlreadyExists(RelayError):
    code = Code.ALREADY_EXISTS


class ResourceExhausted(RelayError):
    code = Code.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_seconds: float | None = None) -> None:
        trailers: tuple[tuple[str, str], ...] = ()
        #: When to retry (rate limits), in milliseconds; 0 when retrying will not help.
        self.retry_after_ms = 0
        if retry_after_seconds is not None:
            self.retry_after_ms = max(1, round(retry_after_seconds * 1000))
            trailers = ((RETRY_AFTER_TRAILER, str(self.retry_after_ms)),)
        super().__init__(message, trailers)


class StaleEpoch(RelayError):
    """FAILED_PRECONDITION: the epoch fence refused a message; carries the channel's epoch."""

    code = Code.FAILED_PRECONDITION

    def __init__(self, message_epoch: int, current_epoch: int) -> None:
        super().__init__(
            f"stale epoch: message epoch {message_epoch}, channel epoch {current_epoch}",
            ((CURRENT_EPOCH_TRAILER, str(current_epoch)),),
        )
        self.current_epoch = current_epoch


class Unauthenticated(RelayError):
    code = Code.UNAUTHENTICATED


class Unavailable(RelayError):
    code = Code.UNAVAILABLE


class Unimplemented(RelayError):
    code = Code.UNIMPLEMENTED
