"""static._native from Python: MLS flows, threads, persistence and the error classes."""

import contextlib
import os
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from static._errors import InternalError, InvalidChannelNameError, MLSEngineError
from static._native.bench import synthetic_key_packages
from static._native.mls import PAST_EPOCHS, Engine, validate_channel_name

CH = "acme/agents/planner"


def make(tmp_path: Path, name: str) -> Engine:
    return Engine(str(tmp_path / name), name.encode())


def pair(tmp_path: Path) -> tuple[Engine, Engine]:
    a, b = make(tmp_path, "alice"), make(tmp_path, "bob")
    a.create_group(CH)
    commit, welcome = a.add_member(CH, b.generate_key_package())
    own = a.process_incoming(CH, commit)
    assert (own.kind, own.epoch) == ("own_commit", 1)
    b.join_group(CH, welcome)
    return a, b


def test_two_members_roundtrip(tmp_path: Path) -> None:
    a, b = pair(tmp_path)
    assert a.epoch(CH) == b.epoch(CH) == 1
    assert a.epoch_authenticator(CH) == b.epoch_authenticator(CH)
    msg = a.encrypt(CH, b"hello")
    got = b.process_incoming(CH, msg)
    assert (got.kind, got.sender, got.payload, got.epoch) == ("application", b"alice", b"hello", 1)
    assert a.process_incoming(CH, msg).kind == "own"
    assert [m[1] for m in a.members(CH)] == [b"alice", b"bob"]
    assert a.groups() == [CH]
    assert a.has_group(CH) and not a.has_group("x/y/z")
    assert a.identity == b"alice"
    assert len(a.signature_public_key) == 32


def test_third_member_update_remove(tmp_path: Path) -> None:
    a, b = pair(tmp_path)
    c = make(tmp_path, "carol")
    commit, welcome = a.add_member(CH, c.generate_key_package())
    assert a.merge_pending_commit(CH) == 2
    assert b.process_incoming(CH, commit).kind == "commit"
    c.join_group(CH, welcome)
    early = c.encrypt(CH, b"before")
    update = b.self_update(CH)
    assert b.has_pending_commit(CH) and b.pending_commit(CH) == update
    assert b.process_incoming(CH, update).kind == "own_commit"
    assert a.process_incoming(CH, update).epoch == 3
    assert c.process_incoming(CH, update).epoch == 3
    assert a.process_incoming(CH, early).payload == b"before"
    removal = a.remove_member(CH, b"carol")
    a.merge_pending_commit(CH)
    b.process_incoming(CH, removal)
    assert c.process_incoming(CH, removal).kind == "removed"
    assert not c.has_group(CH)
    with pytest.raises(MLSEngineError):
        c.encrypt(CH, b"x")
    assert [m[1] for m in b.members(CH)] == [b"alice", b"bob"]


def test_reopen_keeps_groups_and_key(tmp_path: Path) -> None:
    a, b = pair(tmp_path)
    key = a.signature_public_key
    a.close()
    with pytest.raises(InternalError):
        a.epoch(CH)
    with Engine(tmp_path / "alice", b"alice") as again:
        assert again.groups() == [CH]
        assert again.epoch(CH) == 1
        assert again.signature_public_key == key
        got = b.process_incoming(CH, again.encrypt(CH, b"back"))
        assert got.payload == b"back"


def test_data_dir_lock_is_a_runtime_error(tmp_path: Path) -> None:
    a = make(tmp_path, "alice")
    with pytest.raises(InternalError) as info:
        make(tmp_path, "alice")
    assert isinstance(info.value, RuntimeError)
    assert str(info.value).startswith("runtime error:")
    assert "in use" in str(info.value)
    a.close()
    make(tmp_path, "alice").close()


def test_error_classes_and_prefixes(tmp_path: Path) -> None:
    a, b = pair(tmp_path)
    with pytest.raises(InvalidChannelNameError) as name_err:
        a.create_group("not-a-channel")
    text = str(name_err.value)
    assert text.startswith("invalid channel name:")
    assert "not-a-channel" in text and "org/namespace/service" in text
    assert isinstance(name_err.value, RuntimeError)
    with pytest.raises(InvalidChannelNameError):
        validate_channel_name("a/b")
    validate_channel_name(CH)

    bad_inputs: list[bytes] = [b"", b"\x00", b"\x00\x01\x00\x02garbage", os.urandom(200)]
    for bad in bad_inputs:
        with pytest.raises(MLSEngineError) as mls_err:
            b.process_incoming(CH, bad)
        assert str(mls_err.value).startswith("MLS engine error:")
        with pytest.raises(MLSEngineError):
            a.add_member(CH, bad)
        with pytest.raises(MLSEngineError):
            make(tmp_path, f"x{len(bad)}").join_group(CH, bad)
    # A Welcome for someone else, and a Welcome under the wrong channel name.
    c = make(tmp_path, "carol")
    _, welcome = a.add_member(CH, make(tmp_path, "dave").generate_key_package())
    with pytest.raises(MLSEngineError):
        c.join_group(CH, welcome)
    a.clear_pending_commit(CH)
    _, welcome = a.add_member(CH, c.generate_key_package())
    with pytest.raises(MLSEngineError, match="not channel"):
        c.join_group("acme/agents/other", welcome)
    # Replays are refused.
    msg = a.encrypt(CH, b"once")
    b.process_incoming(CH, msg)
    with pytest.raises(MLSEngineError):
        b.process_incoming(CH, msg)


def test_mutated_messages_never_crash(tmp_path: Path) -> None:
    a, b = pair(tmp_path)
    rng = random.Random(7)
    msg = a.encrypt(CH, b"payload")
    for _ in range(200):
        mutated = bytearray(msg)
        for _ in range(rng.randint(1, 4)):
            mutated[rng.randrange(len(mutated))] ^= 1 << rng.randrange(8)
        if rng.random() < 0.3:
            mutated = mutated[: rng.randint(0, len(mutated))]
        with contextlib.suppress(MLSEngineError):
            b.process_incoming(CH, bytes(mutated))
    got = b.process_incoming(CH, a.encrypt(CH, b"still works"))
    assert got.payload == b"still works"


def test_threads_hammer_one_group(tmp_path: Path) -> None:
    a, b = pair(tmp_path)
    log: list[tuple[bytes, bytes]] = []
    lock = threading.Lock()

    def sender(t: int) -> None:
        for i in range(40):
            payload = f"{t}-{i}".encode()
            # Encrypt and log under one lock: a receiver tolerates only a few messages out of
            # generation order (the SDK keeps encryption order the same way, send/encrypt.rs).
            # Logged outside it, a preempted thread's message fell behind more than that on a
            # loaded CI machine. The reads below still race the other threads' encrypts.
            with lock:
                log.append((payload, a.encrypt(CH, payload)))
            a.members(CH)
            a.epoch(CH)

    with ThreadPoolExecutor(max_workers=4) as pool:
        # result() re-raises any failure of a thread.
        for future in [pool.submit(sender, t) for t in range(4)]:
            future.result()
    assert len(log) == 160
    for payload, ct in log:
        got = b.process_incoming(CH, ct)
        assert (got.sender, got.payload) == (b"alice", payload)


def test_leave(tmp_path: Path) -> None:
    a, b = pair(tmp_path)
    proposal = b.leave(CH)
    assert a.process_incoming(CH, proposal).kind == "proposal"
    commit = a.commit_pending_proposals(CH)
    assert commit is not None
    assert a.process_incoming(CH, commit).kind == "own_commit"
    assert b.process_incoming(CH, commit).kind == "removed"
    assert b.groups() == []
    assert a.commit_pending_proposals(CH) is None


def _varint(data: bytes, at: int) -> tuple[int, int]:
    """An RFC 9420 variable-length integer at ``at``: (value, offset after it)."""
    size = 1 << (data[at] >> 6)
    value = data[at] & 0x3F
    for byte in data[at + 1 : at + size]:
        value = (value << 8) | byte
    return value, at + size


def _vector(data: bytes, at: int) -> tuple[bytes, int]:
    n, at = _varint(data, at)
    return data[at : at + n], at + n


def _first_leaf_keys(ratchet_tree: bytes) -> tuple[bytes, bytes]:
    """(encryption key, signature key) of leaf 0: the tree's first node, present, a leaf."""
    _, at = _varint(ratchet_tree, 0)
    assert ratchet_tree[at : at + 2] == b"\x01\x01"
    encryption_key, at = _vector(ratchet_tree, at + 2)
    signature_key, _ = _vector(ratchet_tree, at)
    return encryption_key, signature_key


def _binding_tbs(channel: str, account: str, encryption_key: bytes) -> bytes:
    """SignContent of RFC 9420 §5.1.2 for the leaf binding (static_mls::binding), short fields."""

    def vec(b: bytes) -> bytes:
        assert len(b) < 0x4000
        return bytes([len(b)]) if len(b) < 0x40 else (0x4000 | len(b)).to_bytes(2, "big")

    content = b"".join(vec(x) + x for x in (channel.encode(), account.encode(), encryption_key))
    label = b"MLS 1.0 static relay leaf binding"
    return vec(label) + label + vec(content) + content


def test_public_state_and_leaf_binding(tmp_path: Path) -> None:
    a, b = pair(tmp_path)
    group_info, tree = a.public_state(CH)
    # MLSMessage, version mls10, wire format group_info.
    assert group_info[:4] == b"\x00\x01\x00\x04"
    encryption_key, signature_key = _first_leaf_keys(tree)
    assert signature_key == a.signature_public_key
    assert b.public_state(CH)[1] == tree

    index, signature = a.leaf_binding(CH, "account-a")
    assert index == 0
    key = Ed25519PublicKey.from_public_bytes(signature_key)
    key.verify(signature, _binding_tbs(CH, "account-a", encryption_key))
    with pytest.raises(InvalidSignature):
        key.verify(signature, _binding_tbs(CH, "account-b", encryption_key))
    assert b.leaf_binding(CH, "account-a")[0] == 1

    # Handshakes are PublicMessages, application messages PrivateMessages.
    update = a.self_update(CH)
    assert update[:4] == b"\x00\x01\x00\x01"
    a.merge_pending_commit(CH)
    b.process_incoming(CH, update)
    assert a.encrypt(CH, b"x")[:4] == b"\x00\x01\x00\x02"
    new_encryption_key, _ = _first_leaf_keys(a.public_state(CH)[1])
    assert new_encryption_key != encryption_key
    _, renewed = a.leaf_binding(CH, "account-a")
    assert renewed != signature
    key.verify(renewed, _binding_tbs(CH, "account-a", new_encryption_key))
    with pytest.raises(InvalidSignature):
        key.verify(signature, _binding_tbs(CH, "account-a", new_encryption_key))

    with pytest.raises(MLSEngineError, match=r"^MLS engine error: not a member"):
        a.public_state("x/y/z")
    with pytest.raises(MLSEngineError, match=r"^MLS engine error: not a member"):
        a.leaf_binding("x/y/z", "account-a")


def test_one_identity_one_leaf(tmp_path: Path) -> None:
    a, _ = pair(tmp_path)
    other_bob = Engine(str(tmp_path / "bob2"), b"bob")
    with pytest.raises(MLSEngineError) as err:
        a.add_member(CH, other_bob.generate_key_package())
    assert str(err.value).startswith(
        "MLS engine error: cannot add b'bob': a member with this identity is already in channel"
    )
    assert not a.has_pending_commit(CH)
    dave1 = Engine(str(tmp_path / "dave1"), b"dave")
    dave2 = Engine(str(tmp_path / "dave2"), b"dave")
    with pytest.raises(MLSEngineError, match="twice in one commit"):
        a.add_members(CH, [dave1.generate_key_package(), dave2.generate_key_package()])
    a.add_member(CH, dave1.generate_key_package())


def _wal_bytes(engine_dir: Path) -> int:
    wal = engine_dir / "mls.sqlite3-wal"
    return wal.stat().st_size if wal.exists() else 0


def _written_per_message(tmp_path: Path, n: int) -> tuple[int, int]:
    """WAL bytes written by 10 messages (sender, receiver) in a group of ``n`` that has seen
    enough commits to keep its full count of past epochs."""
    a, b = make(tmp_path, f"a{n}"), make(tmp_path, f"b{n}")
    a.create_group(CH)
    _, welcome = a.add_members(CH, [b.generate_key_package(), *synthetic_key_packages(n - 2)])
    a.merge_pending_commit(CH)
    b.join_group(CH, welcome)
    for _ in range(PAST_EPOCHS + 1):
        commit = a.self_update(CH)
        a.merge_pending_commit(CH)  # an epoch change truncates the WAL...
        b.process_incoming(CH, commit)  # ...on both sides
    assert _wal_bytes(tmp_path / f"a{n}") == _wal_bytes(tmp_path / f"b{n}") == 0
    # Fewer commits than the background checkpoint waits for: the WAL holds all they wrote.
    for _ in range(10):
        assert b.process_incoming(CH, a.encrypt(CH, bytes(1024))).kind == "application"
    written = (_wal_bytes(tmp_path / f"a{n}"), _wal_bytes(tmp_path / f"b{n}"))
    a.close()
    b.close()
    return written


def test_a_message_writes_no_more_in_a_large_group(tmp_path: Path) -> None:
    # The past epochs' part of the message secrets (their member lists: ~55 KB at N=128) is
    # rewritten by commits, not by messages of the current epoch.
    small = _written_per_message(tmp_path, 2)
    large = _written_per_message(tmp_path, 128)
    for side, (at_2, at_128) in zip(
        ("sender", "receiver"), zip(small, large, strict=True), strict=True
    ):
        assert 0 < at_128 <= at_2 + 10 * 4096 + 4096, (side, at_2, at_128)
