"""A tiny encoder of RFC 9420 MLSMessages: just enough framing to build the relay's test vectors.

The bytes after the cleartext header are filler (the relay never reads them).
"""

from __future__ import annotations

import hashlib

MLS10 = 1
PUBLIC, PRIVATE, WELCOME, GROUP_INFO, KEY_PACKAGE = 1, 2, 3, 4, 5
APPLICATION, PROPOSAL, COMMIT = 1, 2, 3


def varint(n: int) -> bytes:
    """RFC 9000 §16 variable-length integer (1, 2 or 4 bytes, as MLS uses it)."""
    if n < 1 << 6:
        return n.to_bytes(1, "big")
    if n < 1 << 14:
        return (n | 0x4000).to_bytes(2, "big")
    if n < 1 << 30:
        return (n | 0x8000_0000).to_bytes(4, "big")
    raise ValueError("too long for an MLS vector")


def vec(data: bytes) -> bytes:
    return varint(len(data)) + data


def _preamble(wire_format: int) -> bytes:
    return MLS10.to_bytes(2, "big") + wire_format.to_bytes(2, "big")


def public_message(
    group_id: bytes | str,
    epoch: int,
    content_type: int,
    body: bytes = b"body",
    *,
    sender_type: int = 1,
) -> bytes:
    gid = group_id.encode() if isinstance(group_id, str) else group_id
    sender = sender_type.to_bytes(1, "big") + (b"\0\0\0\1" if sender_type in (1, 2) else b"")
    return (
        _preamble(PUBLIC)
        + vec(gid)
        + epoch.to_bytes(8, "big")
        + sender
        + vec(b"")
        + content_type.to_bytes(1, "big")
        + vec(body)
        + vec(b"signature")
        + vec(b"tag")
    )


def private_message(
    group_id: bytes | str, epoch: int, content_type: int, ciphertext: bytes = b"ciphertext"
) -> bytes:
    gid = group_id.encode() if isinstance(group_id, str) else group_id
    return (
        _preamble(PRIVATE)
        + vec(gid)
        + epoch.to_bytes(8, "big")
        + content_type.to_bytes(1, "big")
        + vec(b"")
        + vec(b"encrypted sender data")
        + vec(ciphertext)
    )


def application(channel: str, epoch: int, payload: bytes = b"hello") -> bytes:
    return private_message(channel, epoch, APPLICATION, payload)


def commit(channel: str, epoch: int, salt: bytes = b"") -> bytes:
    return public_message(channel, epoch, COMMIT, b"commit" + salt)


def welcome(key_package_refs: list[bytes], cipher_suite: int = 1) -> bytes:
    secrets = b"".join(vec(ref) + vec(b"kem output") + vec(b"secrets") for ref in key_package_refs)
    return (
        _preamble(WELCOME)
        + cipher_suite.to_bytes(2, "big")
        + vec(secrets)
        + vec(b"encrypted group info")
    )


def read_varint(data: bytes, at: int) -> tuple[int, int]:
    """The RFC 9000 variable-length integer at ``at``: (value, the offset after it)."""
    size = 1 << (data[at] >> 6)
    value = int.from_bytes(data[at : at + size], "big") & ((1 << (8 * size - 2)) - 1)
    return value, at + size


def read_vec(data: bytes, at: int) -> tuple[bytes, int]:
    length, at = read_varint(data, at)
    return data[at : at + length], at + length


def welcome_refs(message: bytes) -> list[bytes]:
    """The KeyPackageRefs an MLSMessage(welcome) names (RFC 9420 §12.4.3.1)."""
    assert message[:4] == _preamble(WELCOME), "not a welcome"
    secrets, _ = read_vec(message, 6)  # after the preamble and the cipher suite
    refs, at = [], 0
    while at < len(secrets):
        ref, at = read_vec(secrets, at)
        refs.append(ref)
        _, at = read_vec(secrets, at)  # the HPKE ciphertext's kem_output
        _, at = read_vec(secrets, at)  # and its ciphertext
    return refs


def key_package_ref(message: bytes) -> bytes:
    """RefHash("MLS 1.0 KeyPackage Reference", KeyPackage) (RFC 9420 §5.2) of an
    MLSMessage(key_package), with SHA-256 (the cipher suite's hash)."""
    assert message[:4] == _preamble(KEY_PACKAGE), "not a key package"
    label = b"MLS 1.0 KeyPackage Reference"
    return hashlib.sha256(vec(label) + vec(message[4:])).digest()


def sized_application(channel: str, body: bytes, size: int = 1024) -> bytes:
    """An application PrivateMessage (epoch 0) of about ``size`` bytes whose ciphertext starts
    with ``body``: the benchmarks' traffic (distinct bodies give distinct idempotency keys, the
    SHA-256 of the message)."""
    bare = private_message(channel, 0, APPLICATION, body)
    # The ciphertext's length prefix grows from 1 to 2 bytes on the way (to 4 past 16 KiB).
    return private_message(channel, 0, APPLICATION, body + bytes(max(0, size - len(bare) - 2)))
