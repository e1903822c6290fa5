"""Hand-encoded protobuf for the relay's hot answers (proto/relay.proto), pure functions.

Building protobuf objects costs an object per entry or result, a copy of every message into it
and another when it is serialized; these produce the same bytes (proto3 canonical encoding:
fields in number order, zero scalars omitted) straight from the values, one copy.
``tests/relay/test_wire.py`` checks them against the generated classes.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "accepted_result",
    "entries_response",
    "entry_field",
    "publish_response",
    "publish_results",
    "varint",
]

_SMALL = [bytes([n]) for n in range(0x80)]


def varint(value: int) -> bytes:
    """``value`` (0 <= value < 2**64) as a protobuf base-128 varint."""
    if value < 0x80:
        return _SMALL[value]
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(tag: bytes, body: bytes) -> bytes:
    """A length-delimited field."""
    return b"".join((tag, varint(len(body)), body))


def entry_field(seq: int, epoch: int, content_type: int, message: bytes) -> bytes:
    """An ``Entry`` as field 1 of its container: both ``SubscribeResponse.entry`` (so this is
    also a whole SubscribeResponse holding one entry) and ``Entries.entries`` are field 1."""
    parts = [b"\x08", varint(seq)] if seq else []
    if epoch:
        parts += (b"\x10", varint(epoch))
    if content_type:
        parts += (b"\x18", varint(content_type))
    if message:
        parts += (b"\x22", varint(len(message)), message)
    return _field(b"\x0a", b"".join(parts))


def entries_response(fields: Sequence[bytes]) -> bytes:
    """A SubscribeResponse holding ``Entries`` made of :func:`entry_field` encodings."""
    return _field(b"\x1a", b"".join(fields))


def publish_response(seq: int, epoch: int, duplicate: bool) -> bytes:
    """A PublishResponse."""
    parts = [b"\x08", varint(seq)] if seq else []
    if epoch:
        parts += (b"\x10", varint(epoch))
    if duplicate:
        parts.append(b"\x18\x01")
    return b"".join(parts)


def accepted_result(response: bytes) -> bytes:
    """A PublishResult whose outcome is ``accepted`` (a :func:`publish_response`)."""
    return _field(b"\x0a", response)


def publish_results(results: Sequence[bytes]) -> bytes:
    """A PublishBatchResponse of serialized PublishResults, in order."""
    return b"".join([_field(b"\x0a", result) for result in results])
