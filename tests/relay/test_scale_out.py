"""Scale-out: several ``static serve`` processes on one PostgreSQL database serve the same
channels. A subscriber on one relay gets what was published on another, in one order, with no
gap and no duplicate; the epoch fence is exact across relays; a relay killed mid-stream loses
nothing (its publishers retry elsewhere with the same idempotency keys, its subscribers resume
elsewhere from their cursor)."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import grpc
import pytest

from tests.relay import mls_vectors as mls
from tests.relay.client import Member, Relay, Subscription, pb, race_commits, status_of
from tests.support.api import Api
from tests.support.postgres import PostgresCluster, find_postgres_bin
from tests.support.server import ServerProcess

CHANNEL = "acme/agents/fleet"
NODES = 3


@pytest.fixture
def nodes(tmp_path: Path, postgres_cluster: PostgresCluster) -> Iterator[list[ServerProcess]]:
    """Three relays on one fresh database (started one after the other: the first migrates)."""
    url = postgres_cluster.create_database()
    started: list[ServerProcess] = []
    try:
        for n in range(NODES):
            server = ServerProcess(tmp_path / f"node{n}", url, ["--allow-anonymous"])
            started.append(server.start())
        yield started
    finally:
        for server in started:
            server.kill()


def _retrying(urls: list[str], start: int, call: Callable[[Relay], object]) -> object:
    """``call`` on the relay at ``urls[start]``, moving on to the next relay while one is
    unreachable (as a client with several relay addresses would)."""
    deadline = time.monotonic() + 30
    index = start
    while True:
        with Relay(urls[index % len(urls)]) as relay:
            try:
                return call(relay)
            except grpc.RpcError as exc:
                code = status_of(exc)[0]
                if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                if time.monotonic() > deadline:
                    raise
        index += 1


def _publish(relay: Relay, *, message: bytes, key: bytes) -> object:
    return relay.publish(CHANNEL, message, key=key)


def test_a_subscriber_on_one_relay_gets_what_was_published_on_another(
    nodes: list[ServerProcess],
) -> None:
    a, b, c = (Relay(n.relay_url) for n in nodes)
    try:
        assert a.create(CHANNEL).epoch == 0
        with pytest.raises(grpc.RpcError) as exists:
            c.create(CHANNEL)  # one channel, whichever relay is asked (another group of that name)
        assert status_of(exists.value)[0] == grpc.StatusCode.ALREADY_EXISTS
        on_b = b.subscribe(CHANNEL, after_seq=0)
        on_c = c.subscribe(CHANNEL, after_seq=0, max_batch=16)
        on_b.wait_keepalives(1)
        on_c.wait_keepalives(1)
        sent = []
        for i in range(30):
            relay = (a, b, c)[i % 3]
            message = mls.application(CHANNEL, 0, f"m{i}".encode())
            answer = relay.publish(CHANNEL, message)
            assert (answer.seq, answer.duplicate) == (i + 1, False)
            sent.append(message)
        for sub in (on_b, on_c):
            entries = sub.wait_for(30)
            assert [e.seq for e in entries] == list(range(1, 31))
            assert [e.message for e in entries] == sent
        # A retry on another relay is a duplicate of the original entry.
        again = c.publish(CHANNEL, sent[4])
        assert (again.seq, again.duplicate) == (5, True)
        # A Welcome kept with a commit on one relay is fetched on another; the joiner binds
        # its leaf on a third, and the relay it was added on knows it as a member.
        group = a.groups[CHANNEL]
        commit = group.add([b])
        welcome = group.welcome
        ref = mls.key_package_ref(group.key_packages[0])
        assert (commit.seq, commit.epoch) == (31, 1)
        by_ref = c.stub.FetchWelcome(
            pb.FetchWelcomeRequest(channel=CHANNEL, key_package_ref=ref), timeout=10
        )
        assert (by_ref.welcome, by_ref.commit_seq, by_ref.epoch) == (welcome, 31, 1)
        by_digest = b.stub.FetchWelcome(
            pb.FetchWelcomeRequest(
                channel=CHANNEL, welcome_sha256=hashlib.sha256(welcome).digest()
            ),
            timeout=10,
        )
        assert by_digest.commit_seq == 31
        # The epoch it started is known everywhere: a joiner reads from there.
        from_epoch = c.subscribe(CHANNEL, from_epoch=1)
        joiner = group.members[1]
        assert joiner.send(CHANNEL, b"welcome aboard").seq == 32
        [entry] = from_epoch.wait_for(1)
        assert entry.seq == 32
        assert group.creator.apply(CHANNEL, entry.message).payload == b"welcome aboard"
        for sub in (on_b, on_c, from_epoch):
            sub.cancel()
    finally:
        for relay in (a, b, c):
            relay.close()


def test_the_epoch_fence_is_exact_across_relays(nodes: list[ServerProcess]) -> None:
    """Six members (the creator added five in one commit, epoch 1) commit an update at each
    epoch at once, on all relays: one wins each epoch, the others apply its commit."""
    urls = [n.relay_url for n in nodes]
    with Relay(urls[0]) as first:
        first.create(CHANNEL)
        group = first.groups[CHANNEL]
        group.add([Relay(urls[n % NODES]) for n in range(1, 2 * NODES)])
        for epoch in range(1, 4):
            won, lost = race_commits(urls, group)
            assert len(won) == 1, (won, lost)
            assert len(lost) == 2 * NODES - 1
            assert (won[0].seq, won[0].epoch) == (epoch + 1, epoch + 1)
            for code, details, trailers in lost:
                assert code == grpc.StatusCode.FAILED_PRECONDITION, (epoch, code, details)
                assert trailers["static-current-epoch"] == str(epoch + 1)
        # Every relay fences at the epoch another relay moved the channel to.
        for url in urls:
            with Relay(url) as relay, pytest.raises(grpc.RpcError) as stale:
                relay.publish(CHANNEL, mls.commit(CHANNEL, 1, b"late"))
            assert status_of(stale.value)[2]["static-current-epoch"] == "4"
        # And every relay checks the next commit against the group the race left.
        for n, url in enumerate(urls):
            with Relay(url) as relay:
                member = group.members[n]
                member.relay, own = relay, member.relay
                assert group.commit(by=member).epoch == 5 + n
                member.relay = own


def test_a_relay_killed_mid_stream_loses_nothing(nodes: list[ServerProcess]) -> None:
    urls = [n.relay_url for n in nodes]
    with Relay(urls[0]) as first:
        first.create(CHANNEL)
    per_publisher = 150
    publishers = NODES
    total = publishers * per_publisher

    # Subscribers on every relay; the one on the killed relay resumes elsewhere.
    subscriptions: dict[int, list[Subscription]] = {}
    clients: list[Relay] = []
    for n, url in enumerate(urls):
        relay = Relay(url)
        clients.append(relay)
        subscriptions[n] = [relay.subscribe(CHANNEL, after_seq=0, timeout=120)]

    progress = [0] * publishers
    errors: list[BaseException] = []

    def publish(n: int) -> None:
        try:
            for i in range(per_publisher):
                message = mls.application(CHANNEL, 0, f"{n}:{i}".encode())
                key = f"key-{n}-{i}".encode()
                _retrying(urls, n, partial(_publish, message=message, key=key))
                progress[n] = i + 1
        except (grpc.RpcError, AssertionError) as exc:  # reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=publish, args=(n,)) for n in range(publishers)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while min(progress) < per_publisher // 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    nodes[0].kill()  # mid-stream: its publisher moves on, its subscriber ends
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert progress == [per_publisher] * publishers

    # The subscriber of the killed relay ended; it resumes on the next relay from its cursor.
    dead = subscriptions[0][0]
    assert dead.wait_end(10) is not None
    cursor = dead.entries[-1].seq if dead.entries else 0
    with Relay(urls[1]) as resumed_on:
        resumed = resumed_on.subscribe(CHANNEL, after_seq=cursor, timeout=60)
        rest = resumed.wait_for(total - cursor, timeout=30)
        combined = [*dead.entries, *rest]
        resumed.cancel()
    everyone = [combined, *(subscriptions[n][0].wait_for(total, timeout=30) for n in (1, 2))]
    expected = {
        mls.application(CHANNEL, 0, f"{n}:{i}".encode())
        for n in range(3)
        for i in range(per_publisher)
    }
    for entries in everyone:
        assert [e.seq for e in entries] == list(range(1, total + 1))  # no gap, no duplicate
        messages = [e.message for e in entries]
        assert set(messages) == expected and len(messages) == total
        for n in range(publishers):  # each publisher's messages in the order it sent them
            own = [mls.application(CHANNEL, 0, f"{n}:{i}".encode()) for i in range(per_publisher)]
            assert [m for m in messages if m in own] == own
    assert [e.message for e in everyone[1]] == [e.message for e in everyone[2]]
    for n in (1, 2):
        subscriptions[n][0].cancel()
    for relay in clients:
        relay.close()


def test_relays_ride_out_a_postgresql_restart(tmp_path: Path) -> None:
    """PostgreSQL goes away for a while and comes back: each relay's writer, readers and
    listener reconnect; publishes retried meanwhile are logged once, and a subscriber on the
    other relay gets everything, woken by the commits after the restart."""
    bindir = find_postgres_bin()
    if bindir is None:
        pytest.skip("PostgreSQL is not installed (scripts/ensure-postgres.sh installs it)")
    cluster = PostgresCluster(bindir)  # its own: the restart must not touch other tests
    cluster.start()
    nodes: list[ServerProcess] = []
    try:
        url = cluster.create_database()
        for n in range(2):
            nodes.append(ServerProcess(tmp_path / f"node{n}", url, ["--allow-anonymous"]).start())
        urls = [n.relay_url for n in nodes]
        with Relay(urls[0]) as a, Relay(urls[1]) as b:
            a.create(CHANNEL)
            on_b = b.subscribe(CHANNEL, after_seq=0, timeout=120)
            on_b.wait_keepalives(1)
            sent = []

            def publish(i: int) -> None:
                message = mls.application(CHANNEL, 0, f"m{i}".encode())
                _retrying([urls[0]], 0, partial(_publish, message=message, key=b"k%d" % i))
                sent.append(message)

            for i in range(10):
                publish(i)
            assert [e.seq for e in on_b.wait_for(10)] == list(range(1, 11))
            cluster.restart(down_for=1.0)
            for i in range(10, 20):
                publish(i)
            entries = on_b.wait_for(20, timeout=30)
            assert [e.seq for e in entries] == list(range(1, 21))
            assert [e.message for e in entries] == sent
            assert on_b.error is None  # the stream lived through the outage
            on_b.cancel()
            # A retry of a message logged before the restart is still a duplicate.
            again = a.publish(CHANNEL, sent[3], key=b"k3")
            assert (again.seq, again.duplicate) == (4, True)
    finally:
        for server in nodes:
            server.kill()
        cluster.stop()


def test_a_removal_on_one_relay_ends_streams_on_another(nodes: list[ServerProcess]) -> None:
    """B's agent reads through one relay, A removes it through another: B's stream gets the
    entries up to the removing commit (so B learns of its removal), then PERMISSION_DENIED
    within a second; B's publishes are refused on every relay."""
    urls = [n.relay_url for n in nodes]
    api = Api(nodes[0].http_url)
    a_token, b_token = (api.token(api.signup().key) for _ in range(2))
    with Relay(urls[0], a_token) as relay_a, Relay(urls[1], b_token) as relay_b:
        relay_a.create(CHANNEL)
        group = relay_a.groups[CHANNEL]
        bob = Member(relay_b, "bob")
        group.add([bob])  # seq 1, epoch 1
        sub = relay_b.subscribe(CHANNEL)
        assert bob.send(CHANNEL, b"from b").seq == 2
        assert [e.seq for e in sub.wait_for(2)] == [1, 2]
        assert group.remove(bob).seq == 3
        removed_at = time.monotonic()
        error = sub.wait_end(timeout=5)
        assert time.monotonic() - removed_at < 1.0
        assert error is not None and status_of(error)[0] == grpc.StatusCode.PERMISSION_DENIED
        assert [e.seq for e in sub.entries] == [1, 2, 3]
        assert sub.entries[-1].message == group.last_commit
        for url in urls:
            with Relay(url, b_token) as again, pytest.raises(grpc.RpcError) as refused:
                again.publish(CHANNEL, mls.application(CHANNEL, 2))
            assert status_of(refused.value)[0] == grpc.StatusCode.PERMISSION_DENIED
    api.close()
