"""Relay benchmark: prints figures, asserts nothing.

    .venv/bin/python bench/relay.py [--messages N] [--idle N] [--only-new]
                                    [--stores sqlite,postgresql]
    .venv/bin/python bench/relay.py --log-growth 400000 [--repeats 3] [--stores ...]

Starts a real ``static serve`` on each store in turn (durable both: SQLite with
synchronous=FULL; PostgreSQL a throwaway cluster of Debian's binaries with fsync on) and
measures the relay, the same Rust relay on both; this process and its subscriber processes are
the load generator (grpcio, with the tests' stubs of proto/relay.proto). Measures, on loopback:

* what the SDK does: 1 -> 1 throughput through PublishBatches (batches of 64, pipelined) to one
  batched subscriber (Subscribe max_batch 256), and the relay's CPU time per message meanwhile;
* the latency of ONE message at low load through an open PublishBatches call: publish -> ack
  and publish -> delivery to a live batched subscriber;
* unary Publish latency (commits and add_member use it);
* 1 publisher -> 1 subscriber throughput (PublishStream, durable);
* 1 -> 10 fan-out deliveries per second;
* publish -> deliver latency p50/p99 at 1,000 msg/s;
* server RSS per idle subscriber with 5,000 of them.

``--log-growth N`` measures only how a publish's cost follows the channel's log: one
pipelined PublishBatches publisher fills a fresh channel (on a fresh database) to N entries and
beyond, and the relay's CPU per message is taken over a window at the empty log and at N,
with their ratio; repeated ``--repeats`` times (a fresh server and database each) for the
spread. :func:`publish_cpu_by_log_size` is that figure for other benchmarks.

The relay's CPU is the ``static serve`` process's; on PostgreSQL the database server's own
processes come on top. Each store's figures print as soon as they are measured; at the end a
table puts the stores side by side, with the PostgreSQL/SQLite ratio of each figure.
"""

from __future__ import annotations

import sys
from pathlib import Path

# bench/ also holds http.py (the HTTP API benchmark): keep it from shadowing the stdlib's http,
# which is why the imports below come after this (E402).
# ruff: noqa: E402
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from tests.relay._generated import relay_pb2 as pb
from tests.relay.client import anonymous_create_request
from tests.relay.mls_vectors import sized_application
from tests.support.postgres import durable_database
from tests.support.server import ServerProcess

SERVICE = "/static.relay.v1.Relay/"
PAYLOAD = 1024
_OPTIONS = [("grpc.use_local_subchannel_pool", 1)]


# -- clients -----------------------------------------------------------------------------------


#: The relay's methods: (how grpc calls them, request type, response type).
_METHODS: dict[str, tuple[str, Any, Any]] = {
    "CreateChannel": ("unary_unary", pb.CreateChannelRequest, pb.CreateChannelResponse),
    "Publish": ("unary_unary", pb.PublishRequest, pb.PublishResponse),
    "PublishBatches": ("stream_stream", pb.PublishBatchRequest, pb.PublishBatchResponse),
    "PublishStream": ("stream_stream", pb.PublishRequest, pb.PublishResponse),
    "Subscribe": ("unary_stream", pb.SubscribeRequest, pb.SubscribeResponse),
}


def _stub(channel: Any, method: str, *, raw_responses: bool = False) -> Any:
    """The callable for the relay's ``method`` on a grpc (or grpc.aio) ``channel``;
    ``raw_responses`` leaves responses as bytes."""
    kind, request, response = _METHODS[method]
    return getattr(channel, kind)(
        SERVICE + method,
        request_serializer=request.SerializeToString,
        response_deserializer=None if raw_responses else response.FromString,
    )


class Client:
    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target, options=_OPTIONS)
        self.create = _stub(self.channel, "CreateChannel")
        self.publish = _stub(self.channel, "Publish")
        self.publish_batches = _stub(self.channel, "PublishBatches")
        self.publish_stream = _stub(self.channel, "PublishStream")
        self.subscribe = _stub(self.channel, "Subscribe")

    def create_channel(self, channel: str) -> None:
        """Creates ``channel`` from a real MLS group (the relay builds the channel's public
        group state from the creator's GroupInfo and binds its leaf to the anonymous account)."""
        self.create(anonymous_create_request(channel), timeout=10)


def _subscriber(target: str, channel: str, count: int, ready: Any, out: Any, stamped: bool) -> None:
    """Subscriber process body: read ``count`` entries; report (first, last, latencies).

    Responses stay raw bytes (no protobuf decoding), so that the load generator, not the relay,
    is the cheap side: a SubscribeResponse holding an entry starts with field 1's tag (0x0a).
    """
    channel_ = grpc.insecure_channel(target, options=_OPTIONS)
    subscribe = _stub(channel_, "Subscribe", raw_responses=True)
    call = subscribe(pb.SubscribeRequest(channel=channel, after_seq=0), timeout=600)
    seen, first, latencies = 0, 0.0, []
    for raw in call:
        if raw[0] != 0x0A:  # a keep-alive
            ready.set()
            continue
        now = time.monotonic_ns()
        if seen == 0:
            first = time.monotonic()
        if stamped:
            body_at = raw.index(b"STAMP") + 5
            latencies.append((now - int(raw[body_at : body_at + 20])) / 1e6)
        seen += 1
        if seen == count:
            break
    call.cancel()
    out.put((first, time.monotonic(), latencies))


def _start_subscribers(
    target: str, channel: str, count: int, n: int, stamped: bool = False
) -> tuple[list[Any], Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs, readies = [], []
    for _ in range(n):
        ready = ctx.Event()
        proc = ctx.Process(target=_subscriber, args=(target, channel, count, ready, out, stamped))
        proc.start()
        procs.append(proc)
        readies.append(ready)
    for ready in readies:
        ready.wait(60)
    return procs, out


def _requests(channel: str, count: int, rate: float | None = None) -> Iterator[pb.PublishRequest]:
    started = time.monotonic()
    for i in range(count):
        if rate is not None:
            delay = started + i / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        body = b"STAMP" + str(time.monotonic_ns()).encode().rjust(20, b"0") + str(i).encode()
        yield pb.PublishRequest(channel=channel, message=sized_application(channel, body, PAYLOAD))


def _batched_subscriber(
    target: str, channel: str, count: int, ready: Any, out: Any, stamped: bool
) -> None:
    """Subscriber process body with ``max_batch``: read ``count`` entries; report (first, last,
    latencies); each latency is taken when the response holding the entry arrives."""
    channel_ = grpc.insecure_channel(target, options=_OPTIONS)
    subscribe = _stub(channel_, "Subscribe")
    call = subscribe(pb.SubscribeRequest(channel=channel, after_seq=0, max_batch=256), timeout=600)
    seen, first, latencies = 0, 0.0, []
    for response in call:
        if response.WhichOneof("item") != "entries":
            ready.set()
            continue
        now = time.monotonic_ns()
        if seen == 0:
            first = time.monotonic()
        for entry in response.entries.entries:
            if stamped:
                body_at = entry.message.index(b"STAMP") + 5
                latencies.append((now - int(entry.message[body_at : body_at + 20])) / 1e6)
            seen += 1
        if seen >= count:
            break
    call.cancel()
    out.put((first, time.monotonic(), latencies))


def _start_batched_subscriber(
    target: str, channel: str, count: int, stamped: bool = False
) -> tuple[Any, Any]:
    ctx = mp.get_context("spawn")
    out, ready = ctx.Queue(), ctx.Event()
    proc = ctx.Process(
        target=_batched_subscriber, args=(target, channel, count, ready, out, stamped)
    )
    proc.start()
    ready.wait(60)
    return proc, out


def cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def batched(target: str, pid: int, channel: str, count: int, size: int = 64) -> tuple[float, float]:
    """(messages/s from one pipelined PublishBatches publisher to one batched subscriber, relay
    CPU microseconds per message meanwhile)."""
    client = Client(target)
    client.create_channel(channel)
    messages = [r.message for r in _requests(channel, count)]  # built before the clock starts
    proc, out = _start_batched_subscriber(target, channel, count)

    def batches() -> Iterator[pb.PublishBatchRequest]:
        for start in range(0, count, size):
            yield pb.PublishBatchRequest(
                requests=[
                    pb.PublishRequest(channel=channel, message=m)
                    for m in messages[start : start + size]
                ]
            )

    cpu_before = cpu_seconds(pid)
    started = time.monotonic()
    accepted = 0
    for response in client.publish_batches(batches(), timeout=600):
        accepted += sum(1 for r in response.results if r.WhichOneof("outcome") == "accepted")
    _, last, _ = out.get(timeout=600)
    cpu = cpu_seconds(pid) - cpu_before
    proc.join(10)
    if accepted != count:
        print(f"  (batched: only {accepted} of {count} publishes were accepted)")
    return count / (last - started), cpu / count * 1e6


def _pipelined(channel: str, start: int, count: int, size: int) -> Iterator[pb.PublishBatchRequest]:
    """``count`` distinct 1 KiB messages from number ``start`` on, in batches of ``size``."""
    for first in range(start, start + count, size):
        yield pb.PublishBatchRequest(
            requests=[
                pb.PublishRequest(
                    channel=channel, message=sized_application(channel, b"m%d" % i, PAYLOAD)
                )
                for i in range(first, min(first + size, start + count))
            ]
        )


def _database_cpu_seconds(database_url: str | None) -> float:
    """The CPU time of the PostgreSQL cluster serving ``database_url`` (its postmaster and
    children, living and reaped); 0 for SQLite, which runs inside the relay."""
    if database_url is None:
        return 0.0
    port = database_url.rpartition(":")[2].partition("/")[0]
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    stats = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stats[int(proc.name)] = (
                (proc / "stat").read_text().rpartition(")")[2].split(),
                (proc / "cmdline").read_bytes(),
            )
        except OSError:
            continue
    masters = {pid for pid, (_, cmdline) in stats.items() if f"port={port}".encode() in cmdline}
    for pid, (fields, _) in stats.items():
        if pid in masters or int(fields[1]) in masters:
            total += sum(int(f) for f in fields[11:15]) / tick
    return total


@dataclass(frozen=True)
class Window:
    """Relay CPU over a window of pipelined publishes that starts at ``entries``."""

    entries: int
    relay_us: float
    database_us: float
    rate: float


def log_growth(
    target: str,
    pid: int,
    database_url: str | None,
    channel: str,
    marks: list[int],
    window: int,
    size: int = 64,
) -> list[Window]:
    """One pipelined PublishBatches publisher fills a fresh ``channel``; for each entry count
    in ``marks`` the relay's CPU per message (and the database's, on PostgreSQL) over the
    ``window`` messages published from there. In between the log is filled as fast as the
    relay takes it. No subscriber: reading is not what grows."""
    client = Client(target)
    client.create_channel(channel)
    windows = []
    published = 0
    for mark in marks:
        if mark > published:
            for _ in client.publish_batches(
                _pipelined(channel, published, mark - published, size), timeout=3600
            ):
                pass
            published = mark
        cpu, db_cpu, started = (
            cpu_seconds(pid),
            _database_cpu_seconds(database_url),
            time.monotonic(),
        )
        accepted = 0
        for response in client.publish_batches(
            _pipelined(channel, published, window, size), timeout=3600
        ):
            accepted += sum(1 for r in response.results if r.WhichOneof("outcome") == "accepted")
        elapsed = time.monotonic() - started
        relay_us = (cpu_seconds(pid) - cpu) / window * 1e6
        database_us = (_database_cpu_seconds(database_url) - db_cpu) / window * 1e6
        if accepted != window:
            print(f"  (log growth: only {accepted} of {window} publishes were accepted)")
        published += window
        windows.append(Window(mark, relay_us, database_us, window / elapsed))
    client.channel.close()
    return windows


def publish_cpu_by_log_size(
    entries: int, repeats: int, store: str, tmp: str, window: int = 20_000
) -> list[list[Window]]:
    """For each of ``repeats`` fresh servers (and databases) on ``store`` ("sqlite" or
    "postgresql"): the relay's CPU per pipelined publish at an empty log and at ``entries``
    (see :func:`log_growth`). Empty when the store cannot run here."""
    marks = sorted({0, entries // 4, entries // 2, entries})
    runs = []
    for run in range(repeats):
        directory = f"{tmp}/growth-{store}-{run}"
        if store == "sqlite":
            runs.append(_growth_run(None, directory, marks, window))
            continue
        with durable_database() as url:
            if url is None:
                return []
            runs.append(_growth_run(url, directory, marks, window))
    return runs


def _growth_run(
    database_url: str | None, directory: str, marks: list[int], window: int
) -> list[Window]:
    server = _start_static(directory, database_url)
    assert server.proc is not None
    try:
        target = server.relay_url.removeprefix("grpc://")
        return log_growth(target, server.proc.pid, database_url, "bench/log/growth", marks, window)
    finally:
        server.stop(30)


def report_growth(store: str, runs: list[list[Window]]) -> None:
    """Each run's windows, then per mark the median and spread (min-max) of the runs and the
    ratio to the empty log."""
    if not runs:
        return
    print(f"publish cost by log size, store: {store} (1 KiB, PublishBatches of 64, pipelined)")
    db = store == "postgresql"
    for i, windows in enumerate(runs):
        cells = ", ".join(
            f"{w.entries:,}: {w.relay_us:.1f} us"
            + (f" (+db {w.database_us:.1f})" if db else "")
            + f" {w.rate:,.0f}/s"
            for w in windows
        )
        print(f"  run {i + 1}: {cells}", flush=True)
    print(f"  {'entries':>9} {'relay us/msg median (min-max)':>32} {'ratio':>7} {'msg/s':>8}")
    base = statistics.median(w[0].relay_us for w in runs)
    for column in range(len(runs[0])):
        values = [w[column].relay_us for w in runs]
        median = statistics.median(values)
        rate = statistics.median(w[column].rate for w in runs)
        cell = f"{median:.1f} ({min(values):.1f}-{max(values):.1f})"
        if db:
            dbs = [w[column].database_us for w in runs]
            cell += f" db {statistics.median(dbs):.1f}"
        print(
            f"  {runs[0][column].entries:>9,} {cell:>32} {median / base:>6.2f}x {rate:>8,.0f}",
            flush=True,
        )


async def _one_by_one(target: str, channel: str, count: int, gap: float) -> list[float]:
    """Ack latencies (ms) of ``count`` single-item batches sent ``gap`` s apart on one call."""
    async with grpc.aio.insecure_channel(target, options=_OPTIONS) as channel_:
        call = _stub(channel_, "PublishBatches")()
        acks = []
        for i in range(count):
            sent = time.monotonic_ns()
            body = b"STAMP" + str(sent).encode().rjust(20, b"0") + str(i).encode()
            item = pb.PublishRequest(
                channel=channel, message=sized_application(channel, body, PAYLOAD)
            )
            await call.write(pb.PublishBatchRequest(requests=[item]))
            await call.read()
            acks.append((time.monotonic_ns() - sent) / 1e6)
            await asyncio.sleep(gap)
        await call.done_writing()
        return acks


def single_latency(
    target: str, pid: int, channel: str, count: int
) -> tuple[tuple[float, float], tuple[float, float], float]:
    """((p50, p99) publish -> ack, (p50, p99) publish -> delivery) in ms, for one message at a
    time (every 5 ms) through an open PublishBatches call and a live batched subscriber, and
    the relay's CPU microseconds per message meanwhile."""
    Client(target).create_channel(channel)
    proc, out = _start_batched_subscriber(target, channel, count, stamped=True)
    cpu_before = cpu_seconds(pid)
    acks = asyncio.run(_one_by_one(target, channel, count, 0.005))
    _, _, deliveries = out.get(timeout=600)
    cpu = cpu_seconds(pid) - cpu_before
    proc.join(10)
    return _p50_p99(acks), _p50_p99(deliveries), cpu / count * 1e6


def unary_latency(target: str, channel: str, count: int) -> tuple[float, float]:
    """(p50, p99) ms of one unary Publish at a time."""
    client = Client(target)
    client.create_channel(channel)
    times = []
    for request in _requests(channel, count):
        started = time.monotonic_ns()
        client.publish(request, timeout=10)
        times.append((time.monotonic_ns() - started) / 1e6)
    return _p50_p99(times)


def _p50_p99(values: list[float]) -> tuple[float, float]:
    values = sorted(values)
    return statistics.median(values), values[max(0, int(len(values) * 0.99) - 1)]


def fan_out(target: str, channel: str, count: int, subscribers: int) -> float:
    """Deliveries per second from one PublishStream publisher to ``subscribers``."""
    client = Client(target)
    client.create_channel(channel)
    procs, out = _start_subscribers(target, channel, count, subscribers)
    started = time.monotonic()
    for _ in client.publish_stream(_requests(channel, count), timeout=600):
        pass
    results = [out.get(timeout=600) for _ in procs]
    for proc in procs:
        proc.join(10)
    elapsed: float = max(last for _, last, _ in results) - started
    return count * subscribers / elapsed


def latency(target: str, channel: str, rate: float, seconds: float) -> tuple[float, float]:
    client = Client(target)
    client.create_channel(channel)
    count = int(rate * seconds)
    procs, out = _start_subscribers(target, channel, count, 1, stamped=True)
    for _ in client.publish_stream(_requests(channel, count, rate), timeout=600):
        pass
    ((_, _, latencies),) = [out.get(timeout=600)]
    procs[0].join(10)
    return _p50_p99(latencies)


async def _idle_subscribers(target: str, channel: str, n: int, hold: Any, ready: Any) -> None:
    per_connection = 100
    channels = [
        grpc.aio.insecure_channel(target, options=_OPTIONS) for _ in range(n // per_connection)
    ]
    calls = []
    for i in range(n):
        subscribe = _stub(channels[i // per_connection], "Subscribe")
        calls.append(subscribe(pb.SubscribeRequest(channel=channel), timeout=600))
    for start in range(0, n, 500):  # each got its first keep-alive: the subscription is live
        await asyncio.gather(*(call.read() for call in calls[start : start + 500]))
    ready.set()
    while not hold.is_set():  # noqa: ASYNC110  (a multiprocessing event)
        await asyncio.sleep(0.1)
    for call in calls:
        call.cancel()
    for ch in channels:
        await ch.close()


def _idle_process(target: str, channel: str, n: int, hold: Any, ready: Any) -> None:
    asyncio.run(_idle_subscribers(target, channel, n, hold, ready))


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def idle_rss(target: str, pid: int, channel: str, n: int) -> tuple[float, float]:
    Client(target).create_channel(channel)
    before = rss_kib(pid)
    ctx = mp.get_context("spawn")
    hold, ready = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_idle_process, args=(target, channel, n, hold, ready))
    proc.start()
    ready.wait(300)
    time.sleep(2)
    after = rss_kib(pid)
    hold.set()
    proc.join(30)
    return (after - before) / n, after / 1024


def commit_cost(directory: str) -> float:
    """p50 ms of one SQLite commit with the store's pragmas (WAL, synchronous=FULL): the
    disk's fsync, the floor of a durable publish's latency."""
    import sqlite3

    conn = sqlite3.connect(os.path.join(directory, "fsync.db"), isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("CREATE TABLE t (b BLOB)")
    costs = []
    for _ in range(100):
        started = time.perf_counter()
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO t VALUES (?)", (b"x" * PAYLOAD,))
        conn.execute("COMMIT")
        costs.append((time.perf_counter() - started) * 1000)
    conn.close()
    return statistics.median(costs)


# -- main --------------------------------------------------------------------------------------


def _start_static(data_dir: str, database_url: str | None) -> ServerProcess:
    """A real ``static serve`` (anonymous relay, no publish rate limit) on loopback."""
    return ServerProcess(
        Path(data_dir),
        database_url,
        extra_args=[
            "--allow-anonymous",
            "--relay-publish-rate",
            "0",
            # Every caller here is the one anonymous account: the idle subscribers (--idle,
            # 5,000 by default) are far past the per-account cap of streams (256), which
            # refused all but 256 of them and made the per-subscriber figure meaningless.
            "--relay-max-streams-per-account",
            "1000000",
        ],
    ).start()


@dataclass(frozen=True)
class Figure:
    """One measured figure: what it is, its unit, and what it is held against."""

    label: str
    unit: str
    note: str = ""


def measure(database_url: str | None, args: argparse.Namespace, tmp: str) -> dict[Figure, float]:
    """Every figure, against one ``static serve`` on ``database_url`` (None: embedded SQLite)."""
    server = _start_static(tmp, database_url)
    target = server.relay_url.removeprefix("grpc://")
    assert server.proc is not None
    pid = server.proc.pid
    n = args.messages
    figures: dict[Figure, float] = {}
    try:
        rate, cpu_us = batched(target, pid, "bench/batch/one", n)
        figures[Figure("1 -> 1 batched (64/batch, max_batch 256)", "msg/s")] = rate
        figures[Figure("  relay CPU meanwhile", "us/msg", "target <= 40")] = cpu_us
        ack, delivery, single_cpu_us = single_latency(target, pid, "bench/single/one", 1000)
        note = "PublishBatches, 1 item, every 5 ms"
        figures[Figure("one message: publish -> ack p50", "ms", note)] = ack[0]
        figures[Figure("one message: publish -> ack p99", "ms", note)] = ack[1]
        figures[Figure("one message: publish -> delivery p50", "ms", "target 0.3")] = delivery[0]
        figures[Figure("one message: publish -> delivery p99", "ms", "target 1")] = delivery[1]
        note = "including keep-alives"
        figures[Figure("one message: relay CPU", "us/msg", note)] = single_cpu_us
        unary = unary_latency(target, "bench/unary/one", 2000)
        figures[Figure("unary Publish p50", "ms", "target <= 0.5")] = unary[0]
        figures[Figure("unary Publish p99", "ms")] = unary[1]
        if not args.only_new:
            one = fan_out(target, "bench/one/one", n, 1)
            figures[Figure("1 -> 1 durable (PublishStream)", "msg/s", "target >= 5,000")] = one
            ten = fan_out(target, "bench/fan/out", n // 4, 10)
            figures[Figure("1 -> 10 fan-out", "deliveries/s", "target >= 20,000")] = ten
            p50, p99 = latency(target, "bench/lat/ency", 1000.0, 5.0)
            figures[Figure("latency at 1,000 msg/s p50", "ms", "target 1")] = p50
            figures[Figure("latency at 1,000 msg/s p99", "ms", "target 5")] = p99
            per_idle, total_mib = idle_rss(target, pid, "bench/idle/subs", args.idle)
            note = "target <= 100"
            figures[Figure(f"{args.idle:,} idle subscribers, each", "KiB", note)] = per_idle
            figures[Figure(f"{args.idle:,} idle subscribers, server RSS", "MiB")] = total_mib
    finally:
        server.stop(30)
    return figures


def _value(value: float) -> str:
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"


def report(store: str, figures: dict[Figure, float]) -> None:
    print(f"relay benchmark, store: {store} (1 KiB messages, loopback)", flush=True)
    for figure, value in figures.items():
        note = f"   ({figure.note})" if figure.note else ""
        print(f"  {figure.label:<44} {_value(value):>10} {figure.unit}{note}", flush=True)


def compare(results: dict[str, dict[Figure, float]]) -> None:
    """Every figure of every store side by side; PostgreSQL / SQLite when both ran."""
    stores = list(results)
    both = "sqlite" in results and "postgresql" in results
    labels: list[Figure] = []
    for figures in results.values():
        labels += [f for f in figures if f not in labels]
    header = f"  {'figure':<44} {'unit':<13}" + "".join(f" {s:>12}" for s in stores)
    print("relay benchmark: all stores" + (", PostgreSQL / SQLite" if both else ""))
    print(header + (f" {'pg/sqlite':>10}" if both else ""))
    for figure in labels:
        values = [results[s].get(figure) for s in stores]
        row = f"  {figure.label:<44} {figure.unit:<13}" + "".join(
            f" {'-' if v is None else _value(v):>12}" for v in values
        )
        if both:
            pg, lite = results["postgresql"].get(figure), results["sqlite"].get(figure)
            row += f" {pg / lite:>9.2f}x" if pg is not None and lite else f" {'-':>10}"
        print(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--idle", type=int, default=5_000)
    parser.add_argument(
        "--only-new", action="store_true", help="only the batched, single-message and unary figures"
    )
    parser.add_argument(
        "--log-growth",
        type=int,
        metavar="ENTRIES",
        help="only the publish cost by log size: relay CPU per message at an empty log and at"
        " ENTRIES (e.g. 400000)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs of --log-growth")
    parser.add_argument(
        "--window", type=int, default=20_000, help="messages per measured window of --log-growth"
    )
    parser.add_argument(
        "--stores",
        default="sqlite,postgresql",
        help="comma-separated stores to run against, in one run (default both; PostgreSQL is a"
        " throwaway cluster of Debian's binaries, skipped when they are missing)",
    )
    args = parser.parse_args()
    stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    for store in stores:
        if store not in ("sqlite", "postgresql"):
            parser.error(f"unknown store {store!r}: sqlite or postgresql")

    if args.log_growth is not None:
        with tempfile.TemporaryDirectory(prefix="static-bench-") as tmp:
            for store in stores:
                runs = publish_cpu_by_log_size(
                    args.log_growth, args.repeats, store, tmp, args.window
                )
                report_growth(store, runs)
        return

    results: dict[str, dict[Figure, float]] = {}
    with tempfile.TemporaryDirectory(prefix="static-bench-") as tmp:
        fsync_ms = commit_cost(tmp)
        print(
            f"one durable SQLite commit (the floor of a durable publish): p50 {fsync_ms:.3f} ms\n",
            flush=True,
        )
        for store in stores:
            if store == "sqlite":
                results[store] = measure(None, args, f"{tmp}/{store}")
            else:
                with durable_database() as url:
                    if url is None:
                        continue
                    results[store] = measure(url, args, f"{tmp}/{store}")
            report(store, results[store])
            print(flush=True)
    if results:
        compare(results)


if __name__ == "__main__":
    main()
