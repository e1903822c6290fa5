"""The relay against a real ``static serve`` process, on both store backends, with grpcio.

Channels are created from real MLS groups and their commits are real (:mod:`tests.relay.client`'s
members); application messages are the fake PrivateMessages of :mod:`tests.relay.mls_vectors`
(the relay cannot read content, so their framing is all it checks). A commit at another epoch
than the channel's is fenced before it is looked at (docs/design.md §5.2), so stale commits may
be fake ones."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from tests.relay import mls_vectors as mls
from tests.relay.client import Member, Relay, pb, race_commits, status_of
from tests.support.server import ServerProcess

CHANNEL = "acme/agents/chat"
Start = Callable[..., ServerProcess]


@pytest.fixture
def anon(start_server: Start) -> ServerProcess:
    return start_server("--allow-anonymous")


@pytest.fixture
def relay(anon: ServerProcess) -> Iterator[Relay]:
    with Relay(anon.relay_url) as client:
        yield client


def test_prints_relay_url_and_round_trips(anon: ServerProcess, relay: Relay) -> None:
    assert anon.relay_url.startswith("grpc://127.0.0.1:")
    created = relay.create(CHANNEL)
    assert (created.channel, created.epoch) == (CHANNEL, 0)
    with pytest.raises(grpc.RpcError) as exists:
        Member(relay).create(CHANNEL)  # another group of that name
    assert status_of(exists.value)[0] == grpc.StatusCode.ALREADY_EXISTS
    first = relay.publish(CHANNEL, mls.application(CHANNEL, 0, b"one"))
    assert (first.seq, first.epoch, first.duplicate) == (1, 0, False)
    sub = relay.subscribe(CHANNEL, after_seq=0)
    sub.wait_keepalives(1)
    relay.publish(CHANNEL, mls.application(CHANNEL, 0, b"two"))
    entries = sub.wait_for(2)
    assert [e.seq for e in entries] == [1, 2]
    assert entries[1].message == mls.application(CHANNEL, 0, b"two")
    assert entries[1].content_type == mls.APPLICATION
    sub.cancel()
    unknown = relay.channel.unary_unary(
        "/static.relay.v1.Relay/Nope",
        request_serializer=pb.CreateChannelRequest.SerializeToString,
        response_deserializer=pb.CreateChannelResponse.FromString,
    )
    with pytest.raises(grpc.RpcError) as unimplemented:
        unknown(pb.CreateChannelRequest(channel=CHANNEL), timeout=5)
    assert status_of(unimplemented.value)[0] == grpc.StatusCode.UNIMPLEMENTED


def test_concurrent_publishers_one_order(relay: Relay) -> None:
    relay.create(CHANNEL)
    sub = relay.subscribe(CHANNEL)
    publishers, per_publisher = 4, 40

    def publish(n: int) -> None:
        with Relay(relay.url) as own:
            half = per_publisher // 2
            for i in range(half):  # one at a time...
                own.publish(CHANNEL, mls.application(CHANNEL, 0, f"{n}:{i}".encode()))
            own.publish_stream(  # ...then batched on one call
                [
                    pb.PublishRequest(
                        channel=CHANNEL, message=mls.application(CHANNEL, 0, f"{n}:{i}".encode())
                    )
                    for i in range(half, per_publisher)
                ]
            )

    threads = [threading.Thread(target=publish, args=(n,)) for n in range(publishers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    total = publishers * per_publisher
    entries = sub.wait_for(total)
    assert [e.seq for e in entries] == list(range(1, total + 1))
    payloads = [e.message for e in entries]
    for n in range(publishers):  # each publisher's messages in the order it sent them
        expected = [mls.application(CHANNEL, 0, f"{n}:{i}".encode()) for i in range(per_publisher)]
        assert [p for p in payloads if p in expected] == expected
    # A second subscriber replaying from the log sees the very same order.
    replay = relay.subscribe(CHANNEL, after_seq=0)
    assert [e.message for e in replay.wait_for(total)] == payloads
    sub.cancel()
    replay.cancel()


def test_two_commits_on_one_epoch_exactly_one_wins(relay: Relay) -> None:
    """Six members at epoch 1 (the creator added five in one commit) each commit an update."""
    relay.create(CHANNEL)
    group = relay.groups[CHANNEL]
    group.add([Relay(relay.url) for _ in range(5)])
    won, lost = race_commits([relay.url], group)
    assert len(won) == 1 and len(lost) == 5
    assert (won[0].seq, won[0].epoch) == (2, 2)
    for code, details, trailers in lost:
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert trailers["static-current-epoch"] == "2"
        assert "channel epoch 2" in details
    # A loser catches up (it applied the winner's commit) and commits on the new epoch.
    loser = next(m for m in group.members if m is not group.last_committer)
    assert group.commit(by=loser).epoch == 3


def test_epoch_rules_for_applications_and_proposals(relay: Relay) -> None:
    relay.create(CHANNEL)
    group = relay.groups[CHANNEL]
    leaver = Member(relay, "leaver")
    group.add([leaver])  # epoch 1
    for _ in range(6):
        group.commit()
    # At epoch 7: applications of epochs 2..7 are accepted, older or future ones refused.
    assert relay.publish(CHANNEL, mls.application(CHANNEL, 2)).epoch == 7
    for stale in (1, 8):
        with pytest.raises(grpc.RpcError) as refused:
            relay.publish(CHANNEL, mls.application(CHANNEL, stale))
        code, _, trailers = status_of(refused.value)
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert trailers["static-current-epoch"] == "7"
    with pytest.raises(grpc.RpcError) as proposal:
        relay.publish(CHANNEL, mls.public_message(CHANNEL, 6, mls.PROPOSAL))
    assert status_of(proposal.value)[0] == grpc.StatusCode.FAILED_PRECONDITION
    # A real proposal (a member's leave) at the current epoch is accepted, and moves nothing.
    assert relay.publish(CHANNEL, leaver.engine.leave(CHANNEL)).epoch == 7
    leaver.close()


def test_idempotent_retry_returns_the_original_seq(relay: Relay) -> None:
    relay.create(CHANNEL)
    message = mls.application(CHANNEL, 0, b"once")
    first = relay.publish(CHANNEL, message)
    relay.publish(CHANNEL, mls.application(CHANNEL, 0, b"other"))
    again = relay.publish(CHANNEL, message)
    assert (again.seq, again.duplicate, first.duplicate) == (first.seq, True, False)
    keyed = relay.publish(CHANNEL, mls.application(CHANNEL, 0, b"a"), key=b"id-1")
    retried = relay.publish(CHANNEL, mls.application(CHANNEL, 0, b"a2"), key=b"id-1")
    assert (retried.seq, retried.duplicate) == (keyed.seq, True)
    # A retried commit is not fenced again: it gets its original answer.
    commit = relay.member.update(CHANNEL)
    won = relay.member.publish_commit(CHANNEL, commit)
    assert relay.publish(CHANNEL, commit) == pb.PublishResponse(
        seq=won.seq, epoch=1, duplicate=True
    )
    # Retries mixed with new messages in one batch (and twice within it).
    fresh = [mls.application(CHANNEL, 1, f"new{i}".encode()) for i in range(3)]
    batch = [fresh[0], message, fresh[1], fresh[1], fresh[2]]
    answers = relay.publish_stream([pb.PublishRequest(channel=CHANNEL, message=m) for m in batch])
    assert [(a.seq, a.duplicate) for a in answers] == [
        (5, False),
        (first.seq, True),
        (6, False),
        (6, True),
        (7, False),
    ]
    sub = relay.subscribe(CHANNEL)
    assert len(sub.wait_for(7)) == 7
    sub.wait_keepalives(2)
    assert len(sub.entries) == 7  # nothing appended twice
    sub.cancel()


def test_replay_then_live_across_a_restart(anon: ServerProcess) -> None:
    with Relay(anon.relay_url) as relay:
        relay.create(CHANNEL)
        for i in range(10):
            relay.publish(CHANNEL, mls.application(CHANNEL, 0, f"m{i}".encode()))
        live = relay.subscribe(CHANNEL, after_seq=4)
        assert [e.seq for e in live.wait_for(6)] == list(range(5, 11))
        for i in range(10, 15):
            relay.publish(CHANNEL, mls.application(CHANNEL, 0, f"m{i}".encode()))
        assert [e.seq for e in live.wait_for(11)] == list(range(5, 16))
        last = live.entries[-1].seq
        anon.restart()
        error = live.wait_end()
        assert error is not None
    with Relay(anon.relay_url) as relay:
        resumed = relay.subscribe(CHANNEL, after_seq=last)
        for i in range(15, 20):
            relay.publish(CHANNEL, mls.application(CHANNEL, 0, f"m{i}".encode()))
        entries = resumed.wait_for(5)
        assert [e.seq for e in entries] == list(range(16, 21))
        assert entries[0].message == mls.application(CHANNEL, 0, b"m15")
        everything = relay.subscribe(CHANNEL).wait_for(20)
        assert [e.message for e in everything] == [
            mls.application(CHANNEL, 0, f"m{i}".encode()) for i in range(20)
        ]


def test_subscribe_from_epoch_and_welcomes(relay: Relay) -> None:
    relay.create(CHANNEL)
    group = relay.groups[CHANNEL]
    relay.publish(CHANNEL, mls.application(CHANNEL, 0, b"before"))
    commit = group.add([Relay(relay.url), Relay(relay.url)])
    welcome = group.welcome
    assert (commit.seq, commit.epoch) == (2, 1)
    # The refs a Welcome names are those of its key packages (RFC 9420's RefHash).
    refs = [mls.key_package_ref(kp) for kp in group.key_packages]
    assert mls.welcome_refs(welcome) == refs
    relay.publish(CHANNEL, mls.application(CHANNEL, 1, b"after"))
    joined = relay.subscribe(CHANNEL, from_epoch=1)
    assert [e.seq for e in joined.wait_for(1)] == [3]
    assert joined.entries[0].message == mls.application(CHANNEL, 1, b"after")
    assert [e.seq for e in relay.subscribe(CHANNEL, from_epoch=0).wait_for(3)] == [1, 2, 3]
    with pytest.raises(grpc.RpcError) as future:
        list(relay.stub.Subscribe(pb.SubscribeRequest(channel=CHANNEL, from_epoch=9), timeout=5))
    assert status_of(future.value)[0] == grpc.StatusCode.NOT_FOUND
    fetched = relay.stub.FetchWelcome(
        pb.FetchWelcomeRequest(channel=CHANNEL, key_package_ref=refs[1]), timeout=5
    )
    assert (fetched.welcome, fetched.commit_seq, fetched.epoch) == (welcome, 2, 1)
    by_digest = relay.stub.FetchWelcome(
        pb.FetchWelcomeRequest(channel=CHANNEL, welcome_sha256=hashlib.sha256(welcome).digest()),
        timeout=5,
    )
    assert by_digest.commit_seq == 2
    with pytest.raises(grpc.RpcError) as unknown:
        relay.stub.FetchWelcome(
            pb.FetchWelcomeRequest(channel=CHANNEL, key_package_ref=b"nope"), timeout=5
        )
    assert status_of(unknown.value)[0] == grpc.StatusCode.NOT_FOUND
    # A refused commit keeps no welcome.
    with pytest.raises(grpc.RpcError):
        relay.publish(CHANNEL, mls.commit(CHANNEL, 0, b"late"), welcome=mls.welcome([b"kp-x"]))
    with pytest.raises(grpc.RpcError):
        relay.stub.FetchWelcome(
            pb.FetchWelcomeRequest(channel=CHANNEL, key_package_ref=b"kp-x"), timeout=5
        )


def test_malformed_oversized_and_misaddressed_messages(relay: Relay) -> None:
    relay.create(CHANNEL)

    def refused(call: Callable[[], object]) -> tuple[grpc.StatusCode, str, dict[str, str]]:
        with pytest.raises(grpc.RpcError) as info:
            call()
        return status_of(info.value)

    code, details, _ = refused(lambda: relay.publish(CHANNEL, b"\x00\x01garbage"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "malformed MLS message" in details
    code, details, _ = refused(
        lambda: relay.publish(CHANNEL, mls.application("acme/agents/other", 0))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "another group" in details
    code, details, _ = refused(
        lambda: relay.publish(CHANNEL, mls.application(CHANNEL, 0), welcome=mls.welcome([b"r"]))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "with a commit" in details
    code, _, _ = refused(lambda: relay.publish(CHANNEL, mls.welcome([b"r"])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    code, details, _ = refused(lambda: relay.create_raw("not-a-channel"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "org/namespace/service" in details
    code, _, _ = refused(lambda: relay.create_raw("a/b/" + "c" * 200))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    code, _, _ = refused(
        lambda: relay.publish("acme/agents/none", mls.application("acme/agents/none", 0))
    )
    assert code == grpc.StatusCode.NOT_FOUND
    big = mls.application(CHANNEL, 0, b"x" * (1024 * 1024))
    code, details, _ = refused(lambda: relay.publish(CHANNEL, big))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "1048576" in details
    huge = mls.application(CHANNEL, 0, b"x" * (5 * 1024 * 1024))
    code, details, _ = refused(lambda: relay.publish(CHANNEL, huge))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "transport limit" in details
    # The connection survived all of it.
    at_limit = mls.application(CHANNEL, 0, b"x" * (1024 * 1024 - 100))
    assert relay.publish(CHANNEL, at_limit).seq == 1


def test_batched_publish_stops_at_the_first_refusal(relay: Relay) -> None:
    """Two members at epoch 1 (seq 1 is the add) commit in one pipelined call: the second
    commit loses the epoch to the first."""
    relay.create(CHANNEL)
    group = relay.groups[CHANNEL]
    rival = Member(relay, "rival")
    group.add([rival])
    requests = [
        pb.PublishRequest(channel=CHANNEL, message=mls.application(CHANNEL, 1, b"1")),
        pb.PublishRequest(channel=CHANNEL, message=relay.member.update(CHANNEL)),
        pb.PublishRequest(channel=CHANNEL, message=rival.update(CHANNEL)),
        pb.PublishRequest(channel=CHANNEL, message=mls.application(CHANNEL, 2, b"never")),
    ]
    call = relay.stub.PublishStream(iter(requests), timeout=10)
    answers = []
    with pytest.raises(grpc.RpcError) as refused:
        for answer in call:
            answers.append(answer)
    assert [(a.seq, a.epoch) for a in answers] == [(2, 1), (3, 2)]
    code, _, trailers = status_of(refused.value)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and trailers["static-current-epoch"] == "2"
    relay.member.settle(CHANNEL, accepted=True)
    rival.close()
    # The stale commit was not appended; the request after it may have been (pipelined).
    log = relay.subscribe(CHANNEL)
    log.wait_keepalives(1)
    assert [e.message for e in log.wait_for(3)][1:3] == [r.message for r in requests[:2]]
    assert requests[2].message not in [e.message for e in log.entries]
    log.cancel()


def test_batched_publish_shares_commits_and_keeps_order(relay: Relay) -> None:
    relay.create(CHANNEL)
    messages = [mls.application(CHANNEL, 0, str(i).encode()) for i in range(500)]
    answers = relay.publish_stream(
        [pb.PublishRequest(channel=CHANNEL, message=m) for m in messages]
    )
    assert [a.seq for a in answers] == list(range(1, 501))
    assert [e.message for e in relay.subscribe(CHANNEL).wait_for(500)] == messages


def test_publish_batches_answers_every_item_and_goes_on(relay: Relay) -> None:
    """Two members at epoch 1 (seq 1 is the add); the second's commit loses the epoch."""
    relay.create(CHANNEL)
    group = relay.groups[CHANNEL]
    rival = Member(relay, "rival")
    group.add([rival])

    def request(message: bytes) -> object:
        return pb.PublishRequest(channel=CHANNEL, message=message)

    first = [request(mls.application(CHANNEL, 1, str(i).encode())) for i in range(3)]
    second = [
        request(relay.member.update(CHANNEL)),
        request(rival.update(CHANNEL)),  # loses the epoch: refused, call goes on
        request(b"not mls"),
        request(mls.application(CHANNEL, 1, b"0")),  # a retry of the first item: duplicate
        pb.PublishRequest(
            channel="acme/agents/other", message=mls.application("acme/agents/other", 1)
        ),
        request(mls.application(CHANNEL, 2, b"after")),
    ]
    third = [request(mls.application(CHANNEL, 2, b"last"))]
    answers = relay.publish_batches([first, second, third])
    assert [len(a.results) for a in answers] == [3, 6, 1]
    relay.member.settle(CHANNEL, accepted=True)
    rival.close()
    results = [r for a in answers for r in a.results]
    kinds = [r.WhichOneof("outcome") for r in results]
    assert (
        kinds == ["accepted"] * 4 + ["refused", "refused", "accepted", "refused"] + ["accepted"] * 2
    )
    assert [(r.accepted.seq, r.accepted.epoch) for r in results[:4]] == [
        (2, 1),
        (3, 1),
        (4, 1),
        (5, 2),
    ]
    stale = results[4].refused
    assert stale.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert stale.current_epoch == 2 and "stale epoch" in stale.message
    assert results[5].refused.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert (results[6].accepted.seq, results[6].accepted.duplicate) == (2, True)
    assert results[7].refused.code == grpc.StatusCode.NOT_FOUND.value[0]
    assert [r.accepted.seq for r in results[8:]] == [6, 7]
    log = relay.subscribe(CHANNEL)
    assert len(log.wait_for(7)) == 7
    log.cancel()


def test_publish_batches_refuses_oversized_batches(relay: Relay) -> None:
    relay.create(CHANNEL)
    batch = [
        pb.PublishRequest(channel=CHANNEL, message=mls.application(CHANNEL, 0, str(i).encode()))
        for i in range(1025)
    ]
    with pytest.raises(grpc.RpcError) as refused:
        relay.publish_batches([batch])
    code, details, _ = status_of(refused.value)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "at most 1024" in details


def test_subscribe_in_batches_replays_then_follows_without_gaps(relay: Relay) -> None:
    relay.create(CHANNEL)
    messages = [mls.application(CHANNEL, 0, str(i).encode()) for i in range(300)]
    relay.publish_batches([[pb.PublishRequest(channel=CHANNEL, message=m) for m in messages]])
    sub = relay.subscribe(CHANNEL, after_seq=10, max_batch=100)
    assert [e.seq for e in sub.wait_for(290)] == list(range(11, 301))
    more = [mls.application(CHANNEL, 0, f"live {i}".encode()) for i in range(50)]
    relay.publish_batches([[pb.PublishRequest(channel=CHANNEL, message=m) for m in more]])
    entries = sub.wait_for(340)
    assert [e.seq for e in entries] == list(range(11, 351))
    assert [e.message for e in entries[-50:]] == more
    assert max(sub.batch_sizes) == 100 and len(sub.batch_sizes) < 340
    sub.cancel()


@pytest.mark.parametrize("method", ["PublishStream", "PublishBatches"])
def test_streaming_calls_send_headers_before_any_request(relay: Relay, method: str) -> None:
    # Clients (tonic among them) may wait for the response headers of a streaming call before
    # they send their first request: the relay must not hold its headers for the first answer.
    relay.create(CHANNEL)
    sent = threading.Event()

    def requests() -> Iterator[object]:
        sent.wait(10)
        return
        yield

    call = getattr(relay.stub, method)(requests(), timeout=10, metadata=relay.metadata)
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(call.initial_metadata()), daemon=True)
    reader.start()
    reader.join(5)
    sent.set()
    assert got, "no response headers before the first request"
    assert list(call) == []


def _refusals(relay: Relay, items: list[Any]) -> list[Any]:
    """The outcome of each PublishRequest of ``items``, sent as one PublishBatches request."""
    [response] = relay.publish_batches([items])
    return list(response.results)


def _sender_at(message: bytes) -> int:
    """Where a PublicMessage's sender starts (after the preamble, group id and epoch)."""
    _, at = mls.read_vec(message, 4)
    return at + 8


def test_every_sender_type_and_a_long_group_id_are_read(relay: Relay) -> None:
    """Every sender type is read; only members may send handshakes (the premise changed: an
    external or new-member sender's proposal or commit used to be logged, it is now refused)."""
    # A group id whose length takes a two-byte varint (over 63 bytes).
    long_name = "/".join(["a" * 40, "b" * 40, "c" * 40])
    relay.create(long_name)
    assert relay.publish(long_name, mls.application(long_name, 0, b"x" * 20000)).seq == 1
    assert relay.commit(long_name) == pb.PublishResponse(seq=2, epoch=1)
    relay.create(CHANNEL)
    group = relay.groups[CHANNEL]
    other = Member(relay, "other")
    group.add([other])
    # Real handshakes with their member sender (type 1, 4 bytes) rewritten into the others:
    # external (2, 4 bytes), new_member_proposal (3) and new_member_commit (4, no bytes),
    # without the membership tag a member's message ends with (32 bytes and their length).
    proposal, commit = other.engine.leave(CHANNEL), relay.member.update(CHANNEL)
    p, c = _sender_at(proposal), _sender_at(commit)
    assert proposal[p : p + 5] == b"\x01\x00\x00\x00\x01" and commit[c : c + 5] == bytes(
        [1, 0, 0, 0, 0]
    )
    rewritten = {
        "an external sender": proposal[:p] + b"\x02\x00\x00\x00\x00" + proposal[p + 5 : -33],
        "a new member": proposal[:p] + b"\x03" + proposal[p + 5 : -33],
        "a new member ": commit[:c] + b"\x04" + commit[c + 5 : -33],
    }
    for who, message in rewritten.items():
        with pytest.raises(grpc.RpcError) as refused:
            relay.publish(CHANNEL, message)
        code, details, _ = status_of(refused.value)
        assert code == grpc.StatusCode.PERMISSION_DENIED, details
        assert details == f"{who.strip()} may not send handshakes; only members may"
    # The member's own are accepted: nothing above was logged or moved the epoch.
    assert relay.publish(CHANNEL, proposal) == pb.PublishResponse(seq=2, epoch=1)
    assert relay.member.publish_commit(CHANNEL, commit) == pb.PublishResponse(seq=3, epoch=2)


def test_every_truncation_of_a_message_is_refused(relay: Relay) -> None:
    relay.create(CHANNEL)
    private, public = mls.application(CHANNEL, 0), relay.member.update(CHANNEL)
    # The relay reads a private message's header, and the whole of a handshake (a real
    # commit, checked against the group): every cut of either is refused.
    cuts = [private[:cut] for cut in range(len(private))]
    cuts += [public[:cut] for cut in range(len(public))]
    results = _refusals(relay, [pb.PublishRequest(channel=CHANNEL, message=m) for m in cuts])
    assert [r.WhichOneof("outcome") for r in results] == ["refused"] * len(cuts)
    assert {r.refused.code for r in results} == {grpc.StatusCode.INVALID_ARGUMENT.value[0]}
    # Nothing was appended, and the channel is still at epoch 0.
    assert relay.member.publish_commit(CHANNEL, public) == pb.PublishResponse(seq=1, epoch=1)


def test_garbage_is_refused_with_a_reason(relay: Relay) -> None:
    relay.create(CHANNEL)
    cases = [
        (b"\x00\x02\x00\x02" + b"\x00" * 40, "version"),
        (b"\x00\x01\x00\x09" + b"\x00" * 40, "wire format"),
        (mls.welcome([b"ref"]), "cannot be published"),
        (b"\x00\x01\x00\x05" + b"\x00" * 40, "cannot be published"),  # a key package
        (b"\x00\x01\x00\x02\xc0" + b"\x00" * 40, "variable-length"),
        (mls.private_message(CHANNEL, 1, 9), "content type"),
        (mls.public_message(CHANNEL, 1, 1, sender_type=7), "sender type"),
        (mls.private_message(CHANNEL, 0, 1) + b"junk", "trailing"),
        (mls.private_message(CHANNEL, 2**64 - 1, 1), "epoch"),
    ]
    results = _refusals(
        relay, [pb.PublishRequest(channel=CHANNEL, message=data) for data, _ in cases]
    )
    for (_, why), result in zip(cases, results, strict=True):
        assert result.refused.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], why
        assert "malformed MLS message" in result.refused.message, result.refused.message
        assert why in result.refused.message, result.refused.message


def test_a_commit_with_a_malformed_welcome_is_refused_whole(relay: Relay) -> None:
    relay.create(CHANNEL)
    commit = relay.member.update(CHANNEL)
    whole = mls.welcome([b"ref"])
    bad_welcomes = [mls.welcome([]), commit, *(whole[:cut] for cut in range(1, len(whole)))]
    results = _refusals(
        relay,
        [pb.PublishRequest(channel=CHANNEL, message=commit, welcome=w) for w in bad_welcomes],
    )
    assert [r.WhichOneof("outcome") for r in results] == ["refused"] * len(bad_welcomes)
    assert {r.refused.code for r in results} == {grpc.StatusCode.INVALID_ARGUMENT.value[0]}
    assert all("malformed welcome" in r.refused.message for r in results)
    # None of those commits was appended: the channel is still at epoch 0. A Welcome names its
    # key packages by refs of any length, and any cipher suite.
    long_ref = b"ref-two" * 20
    welcome = mls.welcome([b"ref-one", long_ref], cipher_suite=3)
    answer = relay.member.publish_commit(CHANNEL, commit, welcome)
    assert answer == pb.PublishResponse(seq=1, epoch=1)
    fetched = relay.stub.FetchWelcome(
        pb.FetchWelcomeRequest(channel=CHANNEL, key_package_ref=long_ref), timeout=5
    )
    assert (fetched.welcome, fetched.commit_seq, fetched.epoch) == (welcome, 1, 1)


def test_idempotency_keys_are_at_most_64_bytes(relay: Relay) -> None:
    relay.create(CHANNEL)
    assert relay.publish(CHANNEL, mls.application(CHANNEL, 0), key=b"k" * 64).seq == 1
    with pytest.raises(grpc.RpcError) as refused:
        relay.publish(CHANNEL, mls.application(CHANNEL, 0, b"other"), key=b"k" * 65)
    code, details, _ = status_of(refused.value)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "longer than 64 bytes" in details


def test_retries_and_the_epoch_fence_hold_across_a_restart(anon: ServerProcess) -> None:
    message, keyed = mls.application(CHANNEL, 0, b"once"), mls.application(CHANNEL, 0, b"keyed")
    with Relay(anon.relay_url) as relay:
        relay.create(CHANNEL)
        first = relay.publish(CHANNEL, message)
        by_key = relay.publish(CHANNEL, keyed, key=b"id-1")
        commit = relay.member.update(CHANNEL)
        won = relay.member.publish_commit(CHANNEL, commit)
    anon.restart()
    with Relay(anon.relay_url) as relay:
        # A retry gets its original answer (the epoch it was appended at, here 0).
        assert relay.publish(CHANNEL, message) == pb.PublishResponse(
            seq=first.seq, epoch=first.epoch, duplicate=True
        )
        again = relay.publish(CHANNEL, mls.application(CHANNEL, 0, b"keyed 2"), key=b"id-1")
        assert (again.seq, again.duplicate) == (by_key.seq, True)
        assert relay.publish(CHANNEL, commit) == pb.PublishResponse(
            seq=won.seq, epoch=1, duplicate=True
        )
        with pytest.raises(grpc.RpcError) as stale:
            relay.publish(CHANNEL, mls.commit(CHANNEL, 0, b"late"))
        code, _, trailers = status_of(stale.value)
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert trailers["static-current-epoch"] == "1"
        assert relay.publish(CHANNEL, mls.application(CHANNEL, 1)).seq == 4
