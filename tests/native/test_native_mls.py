"""static._native from Python: MLS flows, threads, persistence and the error classes."""

import contextlib
import os
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from static import _native
from static._errors import InternalError, InvalidChannelNameError, MLSEngineError

CH = "acme/agents/planner"


def make(tmp_path: Path, name: str) -> _native.Engine:
    return _native.Engine(str(tmp_path / name), name.encode())


def pair(tmp_path: Path) -> tuple[_native.Engine, _native.Engine]:
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
    with _native.Engine(tmp_path / "alice", b"alice") as again:
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
        _native.validate_channel_name("a/b")
    _native.validate_channel_name(CH)

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
            ct = a.encrypt(CH, payload)
            with lock:
                log.append((payload, ct))
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
