"""The cleartext MLS header parser and the pure relay rules (no server)."""

from __future__ import annotations

import pytest

from static.relay._errors import InvalidArgument, StaleEpoch, Unauthenticated
from static.relay._framing import (
    ContentType,
    MalformedMessage,
    WireFormat,
    parse_message,
    parse_welcome,
)
from static.relay._rules import TokenBucket, bearer_token, check_fence, idempotency_key
from tests.relay import mls_vectors as mls

CHANNEL = "acme/agents/chat"


def test_public_message_header() -> None:
    header = parse_message(mls.public_message(CHANNEL, 7, mls.COMMIT))
    assert header.wire_format is WireFormat.PUBLIC_MESSAGE
    assert header.group_id == CHANNEL.encode()
    assert header.epoch == 7
    assert header.content_type is ContentType.COMMIT


@pytest.mark.parametrize("sender_type", [1, 2, 3, 4])
def test_public_message_every_sender_type(sender_type: int) -> None:
    message = mls.public_message(CHANNEL, 1, mls.PROPOSAL, sender_type=sender_type)
    assert parse_message(message).content_type is ContentType.PROPOSAL


def test_private_message_header_and_long_group_id() -> None:
    group = b"g" * 300  # a two-byte varint length
    header = parse_message(mls.private_message(group, 2**40, mls.APPLICATION, b"x" * 20000))
    assert header.wire_format is WireFormat.PRIVATE_MESSAGE
    assert header.group_id == group
    assert header.epoch == 2**40
    assert header.content_type is ContentType.APPLICATION


def test_every_truncation_is_refused() -> None:
    for message in [mls.private_message(CHANNEL, 3, mls.APPLICATION), mls.commit(CHANNEL, 3)]:
        cut_points = range(len(message)) if message[3] == 2 else range(len(message) - 24)
        for cut in cut_points:
            with pytest.raises(MalformedMessage):
                parse_message(message[:cut])


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"", "truncated"),
        (b"\x00\x02\x00\x02", "version"),
        (b"\x00\x01\x00\x09", "wire format"),
        (mls.welcome([b"ref"]), "cannot be published"),
        (b"\x00\x01\x00\x05" + b"\x00" * 40, "cannot be published"),
        (b"\x00\x01\x00\x02\xc0" + b"\x00" * 40, "variable-length"),
        (mls.private_message(CHANNEL, 1, 9), "content type"),
        (mls.public_message(CHANNEL, 1, 1, sender_type=7), "sender type"),
        (mls.private_message(CHANNEL, 1, 1) + b"junk", "trailing"),
        (mls.private_message(CHANNEL, 2**64 - 1, 1), "epoch"),
    ],
)
def test_garbage_is_refused_with_a_reason(data: bytes, why: str) -> None:
    with pytest.raises(MalformedMessage, match=why):
        parse_message(data)


def test_welcome_names_its_key_packages() -> None:
    header = parse_welcome(mls.welcome([b"ref-one", b"ref-two" * 20], cipher_suite=3))
    assert header.cipher_suite == 3
    assert header.key_package_refs == (b"ref-one", b"ref-two" * 20)
    with pytest.raises(MalformedMessage):
        parse_welcome(mls.welcome([]))
    with pytest.raises(MalformedMessage):
        parse_welcome(mls.commit(CHANNEL, 0))
    whole = mls.welcome([b"ref"])
    for cut in range(len(whole)):
        with pytest.raises(MalformedMessage):
            parse_welcome(whole[:cut])


def test_epoch_fence() -> None:
    commit = parse_message(mls.commit(CHANNEL, 4))
    check_fence(commit, 4, 5)
    with pytest.raises(StaleEpoch) as stale:
        check_fence(commit, 5, 5)
    assert stale.value.current_epoch == 5
    assert ("static-current-epoch", "5") in stale.value.trailers
    app = parse_message(mls.application(CHANNEL, 2))
    check_fence(app, 2, 5)
    check_fence(app, 7, 5)
    with pytest.raises(StaleEpoch):
        check_fence(app, 8, 5)
    with pytest.raises(StaleEpoch):  # from the future
        check_fence(app, 1, 5)


def test_idempotency_keys() -> None:
    assert idempotency_key(b"", b"m") == idempotency_key(b"", b"m")
    assert idempotency_key(b"", b"m") != idempotency_key(b"", b"n")
    assert idempotency_key(b"k", b"m") == idempotency_key(b"k", b"n")
    with pytest.raises(InvalidArgument):
        idempotency_key(b"k" * 65, b"m")


def test_bearer_header_checks() -> None:
    assert bearer_token(()) is None
    assert bearer_token((("authorization", "Bearer abc.def-_"),)) == "abc.def-_"
    for bad in ["Basic xyz", "Bearer", "Bearer a b", "Bearer a\x00b", "Bearer \x7fa", "x" * 9000]:
        with pytest.raises(Unauthenticated):
            bearer_token((("authorization", bad),))
    with pytest.raises(Unauthenticated):
        bearer_token((("authorization", "Bearer a"), ("authorization", "Bearer b")))


def test_token_bucket() -> None:
    bucket = TokenBucket.full(rate=2, burst=2, now=0.0)
    assert bucket.take(0.0) == 0.0
    assert bucket.take(0.0) == 0.0
    assert bucket.take(0.0) == pytest.approx(0.5)
    assert bucket.take(0.5) == 0.0


def test_the_servers_messages_are_the_protos() -> None:
    # The server builds its messages from the descriptor compiled into the extension; the
    # tests' client uses stubs generated by protoc: the same bytes both ways.
    from static.relay import _proto
    from tests.relay.client import pb

    ours = _proto.PublishBatchRequest(
        requests=[_proto.PublishRequest(channel="a/b/c", message=b"m", idempotency_key=b"k")]
    ).SerializeToString()
    theirs = pb.PublishBatchRequest(
        requests=[pb.PublishRequest(channel="a/b/c", message=b"m", idempotency_key=b"k")]
    )
    assert ours == theirs.SerializeToString()
    response = _proto.SubscribeResponse.FromString(
        pb.SubscribeResponse(keep_alive=pb.KeepAlive(head_seq=7)).SerializeToString()
    )
    assert response.WhichOneof("item") == "keep_alive" and response.keep_alive.head_seq == 7
    assert sorted(_proto.__all__) == sorted(name for name in dir(pb) if name in _proto.__all__)
