"""The cleartext header of RFC 9420 ``MLSMessage``s: what the relay reads, and nothing more.

Pure functions over bytes, no I/O. The relay never decrypts anything: it reads the group id, the
epoch and the content type that public and private messages carry in the clear, and the
KeyPackageRefs that name a Welcome's recipients.

Wire format (RFC 9420 §6, TLS presentation language): ``MLSMessage`` is ``version`` (u16, 1 =
mls10), ``wire_format`` (u16), then the body. Variable-length vectors (``opaque x<V>``) carry a
QUIC-style variable-length integer (RFC 9000 §16, as RFC 9420 §2.1.2 uses it) giving the length.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

__all__ = [
    "ContentType",
    "MalformedMessage",
    "MessageHeader",
    "WelcomeHeader",
    "WireFormat",
    "parse_message",
    "parse_welcome",
]

MLS10 = 1
_MAX_U64 = 2**64 - 1


class MalformedMessage(ValueError):
    """The bytes are not an MLSMessage the relay accepts. ``str(exc)`` says why."""


class WireFormat(enum.IntEnum):
    PUBLIC_MESSAGE = 1
    PRIVATE_MESSAGE = 2
    WELCOME = 3
    GROUP_INFO = 4
    KEY_PACKAGE = 5


class ContentType(enum.IntEnum):
    APPLICATION = 1
    PROPOSAL = 2
    COMMIT = 3


class MessageHeader(NamedTuple):
    """The cleartext header of a public or private message (a NamedTuple: one is made per
    publish, and a frozen dataclass costs several times as much to build)."""

    wire_format: WireFormat
    group_id: bytes
    epoch: int
    content_type: ContentType


@dataclass(frozen=True, slots=True)
class WelcomeHeader:
    """The cleartext part of a Welcome: its cipher suite and the KeyPackageRefs it is for."""

    cipher_suite: int
    key_package_refs: tuple[bytes, ...]


class _Reader:
    __slots__ = ("_data", "_pos")

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._pos = 0

    def take(self, n: int, what: str) -> bytes:
        end = self._pos + n
        if end > len(self._data):
            raise MalformedMessage(f"truncated {what}")
        chunk = self._data[self._pos : end]
        self._pos = end
        return chunk

    def uint(self, size: int, what: str) -> int:
        return int.from_bytes(self.take(size, what), "big")

    def varint(self, what: str) -> int:
        first = self.uint(1, what)
        prefix = first >> 6
        if prefix == 3:
            raise MalformedMessage(f"invalid variable-length integer in {what}")
        value = first & 0x3F
        for _ in range((1 << prefix) - 1):
            value = (value << 8) | self.uint(1, what)
        return value

    def vector(self, what: str) -> bytes:
        return self.take(self.varint(what), what)

    def at_end(self) -> bool:
        return self._pos == len(self._data)


def _content_type(value: int) -> ContentType:
    try:
        return ContentType(value)
    except ValueError:
        raise MalformedMessage(f"unknown content type {value}") from None


def _preamble(reader: _Reader) -> WireFormat:
    version = reader.uint(2, "version")
    if version != MLS10:
        raise MalformedMessage(f"unsupported protocol version {version}")
    wire_format = reader.uint(2, "wire format")
    try:
        return WireFormat(wire_format)
    except ValueError:
        raise MalformedMessage(f"unknown wire format {wire_format}") from None


_CONTENT_TYPES = {int(t): t for t in ContentType}


def _varint_at(data: bytes, pos: int) -> tuple[int, int]:
    """(value, position after it) of the variable-length integer at ``pos``; (-1, pos) when it
    is invalid or truncated (the caller then takes the slow path, which says why)."""
    n = len(data)
    if pos >= n:
        return -1, pos
    first = data[pos]
    prefix = first >> 6
    if prefix == 0:
        return first, pos + 1
    size = 1 << prefix
    if prefix == 3 or pos + size > n:
        return -1, pos
    return int.from_bytes(data[pos : pos + size], "big") & ((1 << (8 * size - 2)) - 1), pos + size


def _private_header(data: bytes) -> MessageHeader | None:
    """The header of a well-formed private message (what nearly every publish is), read with
    plain indexing: about 5x cheaper than :class:`_Reader`. None for anything else."""
    if data[:4] != b"\x00\x01\x00\x02":
        return None
    n = len(data)
    length, pos = _varint_at(data, 4)
    if length < 0 or pos + length + 9 > n:
        return None
    group_id = data[pos : pos + length]
    pos += length
    epoch = int.from_bytes(data[pos : pos + 8], "big")
    content_type = _CONTENT_TYPES.get(data[pos + 8])
    if content_type is None or epoch == _MAX_U64:
        return None
    pos += 9
    for _ in range(3):  # authenticated data, encrypted sender data, ciphertext
        length, pos = _varint_at(data, pos)
        if length < 0:
            return None
        pos += length
    if pos != n:
        return None
    return MessageHeader(WireFormat.PRIVATE_MESSAGE, group_id, epoch, content_type)


def parse_message(data: bytes) -> MessageHeader:
    """Read the header of a public or private ``MLSMessage``; raise :class:`MalformedMessage`."""
    fast = _private_header(data)
    if fast is not None:
        return fast
    reader = _Reader(data)
    wire_format = _preamble(reader)
    if wire_format is WireFormat.PUBLIC_MESSAGE:
        # FramedContent: group_id<V>, epoch u64, sender, authenticated_data<V>, content_type u8.
        group_id = reader.vector("group id")
        epoch = reader.uint(8, "epoch")
        sender_type = reader.uint(1, "sender")
        if sender_type in (1, 2):  # member (leaf index) / external (sender index): u32
            reader.take(4, "sender")
        elif sender_type not in (3, 4):  # new_member_proposal / new_member_commit: empty
            raise MalformedMessage(f"unknown sender type {sender_type}")
        reader.vector("authenticated data")
        content_type = _content_type(reader.uint(1, "content type"))
        if reader.at_end():
            raise MalformedMessage("truncated content")
    elif wire_format is WireFormat.PRIVATE_MESSAGE:
        # group_id<V>, epoch u64, content_type u8, authenticated_data<V>,
        # encrypted_sender_data<V>, ciphertext<V>.
        group_id = reader.vector("group id")
        epoch = reader.uint(8, "epoch")
        content_type = _content_type(reader.uint(1, "content type"))
        reader.vector("authenticated data")
        reader.vector("encrypted sender data")
        reader.vector("ciphertext")
        if not reader.at_end():
            raise MalformedMessage("trailing bytes after the private message")
    else:
        raise MalformedMessage(
            f"wire format {wire_format.name.lower()} cannot be published to a channel"
        )
    if epoch == _MAX_U64:
        raise MalformedMessage("epoch out of range")
    return MessageHeader(wire_format, group_id, epoch, content_type)


def parse_welcome(data: bytes) -> WelcomeHeader:
    """Read an ``MLSMessage`` holding a Welcome; raise :class:`MalformedMessage`."""
    reader = _Reader(data)
    if _preamble(reader) is not WireFormat.WELCOME:
        raise MalformedMessage("not a welcome message")
    cipher_suite = reader.uint(2, "cipher suite")
    secrets = _Reader(reader.vector("secrets"))
    refs: list[bytes] = []
    while not secrets.at_end():
        # EncryptedGroupSecrets: new_member (KeyPackageRef<V>), HPKECiphertext
        # {kem_output<V>, ciphertext<V>}.
        refs.append(secrets.vector("key package ref"))
        secrets.vector("kem output")
        secrets.vector("encrypted group secrets")
    reader.vector("encrypted group info")
    if not reader.at_end():
        raise MalformedMessage("trailing bytes after the welcome")
    if not refs:
        raise MalformedMessage("a welcome for nobody")
    return WelcomeHeader(cipher_suite, tuple(refs))
