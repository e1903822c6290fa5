"""The channel log on a real store: at commit, who is written to first and which connections get
their answers and deliveries in one write; on SQLite, which thread makes the commit."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import NamedTuple

import trio

from static.relay._framing import parse_message
from static.relay._log import ChannelLog, ChannelState, Origin
from static.store import Database, open_database
from static.store._channels import ChannelStore, EntryRecord
from static.store._sqlite import SQLiteDatabase, SyncWriter
from tests.relay import mls_vectors as mls

CHANNEL = "org/log/order"


class _Running(NamedTuple):
    db: Database
    store: ChannelStore
    log: ChannelLog
    state: ChannelState
    nursery: trio.Nursery


@asynccontextmanager
async def _running_log(database_url: str) -> AsyncIterator[_Running]:
    """A fresh store, its channel log with the writer running, and one channel; what the test
    starts in the nursery is cancelled at the end."""
    async with open_database(database_url) as db:
        store = ChannelStore(db)
        log = ChannelLog(store, application_window=4)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(log.run_writer)
            state = await log.create("scope", CHANNEL)
            yield _Running(db, store, log, state, nursery)
            nursery.cancel_scope.cancel()


async def db_entries(store: ChannelStore, state: ChannelState) -> list[EntryRecord]:
    return await store.read(state.record.id, 0, 100)


class _Connection:
    """Records what the log does with a connection: corks, deliveries, answers, writes."""

    def __init__(self, name: str, events: list[tuple[str, str, bool]]) -> None:
        self.name = name
        self.events = events
        self.corked = 0

    def cork(self) -> None:
        self.corked += 1

    def uncork(self) -> None:
        self.corked -= 1
        if not self.corked:
            self.events.append(("write", self.name, False))

    def deliver(self, page: list[EntryRecord]) -> int:
        self.events.append(("deliver", self.name, bool(self.corked)))
        return len(page)


async def _follow(log: ChannelLog, state: ChannelState, connection: _Connection) -> None:
    origin: Origin = connection
    async for page in log.follow(state, 0, 60.0, connection.deliver, origin):
        if page is not None:  # everything is pushed at commit time here
            connection.events.append(("yielded", connection.name, False))


def _alice_and_bob() -> tuple[list[tuple[str, str, bool]], _Connection, _Connection]:
    """Two recorded connections writing to one list of events."""
    events: list[tuple[str, str, bool]] = []
    return events, _Connection("alice", events), _Connection("bob", events)


async def _follow_in_order(run: _Running, *connections: _Connection) -> None:
    """Subscribe ``connections`` to the channel one after the other, each parked at the head
    before the next starts."""
    for n, connection in enumerate(connections, start=1):
        run.nursery.start_soon(_follow, run.log, run.state, connection)
        while len(run.state.followers) < n:  # noqa: ASYNC110  (a test waiting for a task)
            await trio.sleep(0.001)


async def test_other_connections_are_served_first_and_the_publisher_in_one_write(
    database_url: str,
) -> None:
    events, alice, bob = _alice_and_bob()
    async with _running_log(database_url) as run:
        log, state = run.log, run.state
        # Alice's own subscription subscribes first: set order must not matter.
        await _follow_in_order(run, alice, bob)
        for n in range(3):
            message = mls.application(CHANNEL, 0, b"m%d" % n)
            submitted = log.submit(state, parse_message(message), message, b"k%d" % n, origin=alice)

            def answered(name: str = "alice") -> None:
                events.append(("answer", name, alice.corked > 0))

            submitted.on_settled = answered
            result = await log.outcome(submitted)
            assert result.seq == n + 1
            assert events == [
                ("deliver", "bob", False),
                ("answer", "alice", True),
                ("deliver", "alice", True),
                ("write", "alice", False),
            ]
            events.clear()
            # Both subscribers park again before the next one.
            while len(state.followers) < 2:  # noqa: ASYNC110
                await trio.sleep(0.001)
    assert alice.corked == bob.corked == 0


async def test_a_publish_from_elsewhere_is_pushed_to_every_subscriber(database_url: str) -> None:
    events, alice, bob = _alice_and_bob()
    async with _running_log(database_url) as run:
        log, state = run.log, run.state
        await _follow_in_order(run, alice, bob)
        message = mls.application(CHANNEL, 0)
        await log.publish(state, parse_message(message), message, b"k")
        assert sorted(events) == [("deliver", "alice", False), ("deliver", "bob", False)]


class _TaskSteps(trio.abc.Instrument):
    """Counts the steps of the tasks it is told to watch."""

    def __init__(self) -> None:
        self.watched: set[trio.lowlevel.Task] = set()
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task in self.watched:
            self.steps += 1


async def test_a_subscriber_pushed_everything_is_not_woken(database_url: str) -> None:
    events: list[tuple[str, str, bool]] = []
    bob = _Connection("bob", events)
    steps = _TaskSteps()
    async with _running_log(database_url) as run:
        log, state, nursery = run.log, run.state, run.nursery

        async def follow() -> None:
            steps.watched.add(trio.lowlevel.current_task())
            await _follow(log, state, bob)

        nursery.start_soon(follow)
        while not state.followers:  # noqa: ASYNC110
            await trio.sleep(0.001)
        trio.lowlevel.add_instrument(steps)
        for n in range(5):
            message = mls.application(CHANNEL, 0, b"m%d" % n)
            await log.publish(state, parse_message(message), message, b"k%d" % n)
        await trio.sleep(0.05)
        trio.lowlevel.remove_instrument(steps)
        assert events == [("deliver", "bob", False)] * 5
        assert steps.steps == 0


async def test_what_a_push_could_not_send_is_read_by_the_subscriber(database_url: str) -> None:
    async with _running_log(database_url) as run:
        log, state, nursery = run.log, run.state, run.nursery
        pushed: list[int] = []
        read: list[int] = []

        def deliver(page: list[EntryRecord]) -> int:
            # Room for one entry at a time, and none for the second message.
            if page[0].seq == 2:
                return 0
            pushed.append(page[0].seq)
            return 1

        async def follow() -> None:
            async for page in log.follow(state, 0, 60.0, deliver):
                read.extend(e.seq for e in page or ())

        nursery.start_soon(follow)
        while not state.followers:  # noqa: ASYNC110
            await trio.sleep(0.001)
        for n in range(3):
            message = mls.application(CHANNEL, 0, b"m%d" % n)
            await log.publish(state, parse_message(message), message, b"k%d" % n)
            await trio.sleep(0.02)
        # No gap, no duplicate: 1 pushed, 2 read by the task (and 3 after it, read or
        # pushed depending on where the task was).
        assert sorted(pushed + read) == [1, 2, 3]
        assert 2 in read and 1 in pushed


async def test_pushed_entries_hold_back_the_keepalive(database_url: str) -> None:
    async with _running_log(database_url) as run:
        log, state, nursery = run.log, run.state, run.nursery
        yielded: list[float] = []

        async def follow() -> None:
            async for page in log.follow(state, 0, 1.0, lambda page: len(page)):
                assert page is None
                yielded.append(trio.current_time())

        nursery.start_soon(follow)
        while not state.followers:  # noqa: ASYNC110
            await trio.sleep(0.001)
        started = trio.current_time()
        for n in range(25):  # 2.5 s of traffic, an entry every 0.1 s
            message = mls.application(CHANNEL, 0, b"m%d" % n)
            await log.publish(state, parse_message(message), message, b"k%d" % n)
            await trio.sleep(0.1)
        assert yielded == []
        # Then, idle: keep-alives again.
        with trio.fail_after(5):
            while not yielded:  # noqa: ASYNC110
                await trio.sleep(0.05)
        assert yielded[0] - started > 2.5


async def test_an_idle_writer_commits_at_the_end_of_the_read(tmp_path: Path) -> None:
    """SQLite, nothing else writing: the publish is committed, answered and delivered in the
    trio thread before ``commit_pending`` returns (no hand-off to the writer's thread)."""
    async with _running_log(f"sqlite:///{tmp_path / 'static.db'}") as run:
        store, log, state = run.store, run.log, run.state
        message = mls.application(CHANNEL, 0, b"m")
        submitted = log.submit(state, parse_message(message), message, b"k")
        assert not submitted.settled
        log.commit_pending()  # what the connection's reader calls after a read
        assert submitted.settled
        assert log.result(submitted).seq == 1
        assert [e.seq for e in await db_entries(store, state)] == [1]


async def test_a_busy_writer_takes_the_commit_on_its_thread(tmp_path: Path) -> None:
    """While the writer's thread runs another job, the commit queues behind it there (the
    event loop is not blocked), and still lands in order."""
    async with _running_log(f"sqlite:///{tmp_path / 'static.db'}") as run:
        db, store, log, state = run.db, run.store, run.log, run.state
        assert isinstance(db, SQLiteDatabase)
        gate = threading.Event()

        def hold(_writer: SyncWriter) -> None:
            gate.wait()

        db.post_write(hold)
        submitted = []
        for n in range(3):
            message = mls.application(CHANNEL, 0, b"m%d" % n)
            submitted.append(log.submit(state, parse_message(message), message, b"k%d" % n))
        log.commit_pending()
        assert not any(s.settled for s in submitted)
        gate.set()
        results = [await log.outcome(s) for s in submitted]
        assert [r.seq for r in results] == [1, 2, 3]
        assert [e.seq for e in await db_entries(store, state)] == [1, 2, 3]


async def test_a_publish_while_a_reader_hands_out_a_read_waits_for_its_commit(
    tmp_path: Path,
) -> None:
    """The reader promised to call ``commit_pending`` at the end of its read: a publish made
    meanwhile schedules no commit round of its own (only the reader's call commits it), while
    a publish made later by a task still gets that round."""
    async with _running_log(f"sqlite:///{tmp_path / 'static.db'}") as run:
        log, state = run.log, run.state
        log.reader_will_commit()
        message = mls.application(CHANNEL, 0, b"m0")
        by_reader = log.submit(state, parse_message(message), message, b"k0")
        await trio.sleep(0.05)  # plenty of scheduling rounds
        assert not by_reader.settled
        log.commit_pending()
        assert by_reader.settled
        message = mls.application(CHANNEL, 0, b"m1")
        by_task = log.submit(state, parse_message(message), message, b"k1")
        with trio.fail_after(5):
            assert (await log.outcome(by_task)).seq == 2
