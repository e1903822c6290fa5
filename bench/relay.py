"""Relay benchmark: prints figures, asserts nothing.

    .venv/bin/python bench/relay.py [--messages N]

Starts a real ``static serve`` (SQLite, so the Rust relay; durable: synchronous=FULL) and, as a
yardstick of the Python stack, a bare purerpc echo server (same process model, same 1 KiB
messages); this process and its subscriber processes are the load generator (grpcio). Measures,
on loopback:

* 1 publisher -> 1 subscriber throughput (PublishStream, durable);
* 1 -> 10 fan-out deliveries per second;
* publish -> deliver latency p50/p99 at 1,000 msg/s;
* server RSS per idle subscriber with 5,000 of them;
* the echo ceiling: a bare purerpc stream-stream echo, 1 KiB each way;
* what the SDK does: 1 -> 1 throughput through PublishBatches (batches of 64, pipelined) to one
  batched subscriber (Subscribe max_batch 256), and the relay's CPU time per message meanwhile;
* the latency of ONE message at low load through an open PublishBatches call: publish -> ack
  and publish -> delivery to a live batched subscriber;
* unary Publish latency (commits and add_member use it).
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
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc

from static.relay import _proto as pb
from tests.support.server import ServerProcess

SERVICE = "/static.relay.v1.Relay/"
PAYLOAD = 1024
_OPTIONS = [("grpc.use_local_subchannel_pool", 1)]


# -- MLS framing (a private message whose ciphertext is the payload) ---------------------------


def _vec(data: bytes) -> bytes:
    n = len(data)
    if n < 64:
        return bytes([n]) + data
    if n < 16384:
        return (n | 0x4000).to_bytes(2, "big") + data
    return (n | 0x8000_0000).to_bytes(4, "big") + data


def app_message(channel: str, body: bytes) -> bytes:
    """A 1 KiB MLS private message (application, epoch 0) carrying ``body`` first."""
    head = (1).to_bytes(2, "big") + (2).to_bytes(2, "big") + _vec(channel.encode())
    head += (0).to_bytes(8, "big") + b"\x01" + _vec(b"") + _vec(b"sender")
    filler = PAYLOAD - len(head) - 4 - len(body)
    return head + _vec(body + b"\0" * max(0, filler))


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
        yield pb.PublishRequest(channel=channel, message=app_message(channel, body))


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
    client.create(pb.CreateChannelRequest(channel=channel), timeout=10)
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


async def _one_by_one(target: str, channel: str, count: int, gap: float) -> list[float]:
    """Ack latencies (ms) of ``count`` single-item batches sent ``gap`` s apart on one call."""
    async with grpc.aio.insecure_channel(target, options=_OPTIONS) as channel_:
        call = _stub(channel_, "PublishBatches")()
        acks = []
        for i in range(count):
            sent = time.monotonic_ns()
            body = b"STAMP" + str(sent).encode().rjust(20, b"0") + str(i).encode()
            item = pb.PublishRequest(channel=channel, message=app_message(channel, body))
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
    Client(target).create(pb.CreateChannelRequest(channel=channel), timeout=10)
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
    client.create(pb.CreateChannelRequest(channel=channel), timeout=10)
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
    client.create(pb.CreateChannelRequest(channel=channel), timeout=10)
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
    client.create(pb.CreateChannelRequest(channel=channel), timeout=10)
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
    Client(target).create(pb.CreateChannelRequest(channel=channel), timeout=10)
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


# -- the echo ceiling --------------------------------------------------------------------------


def echo_server(port_file: str) -> None:
    """A bare purerpc server: stream-stream echo of 1 KiB messages."""
    import purerpc
    import trio
    from purerpc.rpc import Cardinality, RPCSignature

    async def echo(messages: Any) -> Any:
        async for message in messages:
            yield message

    service = purerpc.Service("bench.Echo")
    service.add_method(
        "Echo",
        echo,
        RPCSignature(Cardinality.STREAM_STREAM, pb.SubscribeResponse, pb.SubscribeResponse),
    )
    server = purerpc.Server(port=0)
    server.add_service(service)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.serve_async)
            Path(port_file).write_text(str(port))  # noqa: ASYNC240  (tiny, once)

    trio.run(main)


def echo_ceiling(target: str, count: int) -> tuple[float, float]:
    """(messages/s through a bare purerpc echo stream, p50 ms of a ping-pong round trip)."""
    channel = grpc.insecure_channel(target, options=_OPTIONS)
    call = channel.stream_stream(
        "/bench.Echo/Echo",
        request_serializer=pb.SubscribeResponse.SerializeToString,
        response_deserializer=pb.SubscribeResponse.FromString,
    )
    message = pb.SubscribeResponse(entry=pb.Entry(seq=1, message=b"x" * PAYLOAD))
    started = time.monotonic()
    received = sum(1 for _ in call(iter([message] * count), timeout=600))
    throughput = received / (time.monotonic() - started)
    # Ping-pong: one message in flight at a time.
    requests: list[Any] = []
    gate = threading.Semaphore(0)

    def paced() -> Iterator[Any]:
        for _ in range(2000):
            requests.append(time.monotonic_ns())
            yield message
            gate.acquire()

    rtts = []
    for _ in call(paced(), timeout=600):
        rtts.append((time.monotonic_ns() - requests[-1]) / 1e6)
        gate.release()
    channel.close()
    return throughput, statistics.median(rtts)


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


def _start_static(data_dir: str) -> ServerProcess:
    """A real ``static serve`` (anonymous relay, no publish rate limit) on loopback."""
    return ServerProcess(
        Path(data_dir), extra_args=["--allow-anonymous", "--relay-publish-rate", "0"]
    ).start()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--idle", type=int, default=5_000)
    parser.add_argument(
        "--only-new", action="store_true", help="only the batched, single-message and unary figures"
    )
    parser.add_argument("--echo-server", metavar="PORT_FILE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.echo_server:
        echo_server(args.echo_server)
        return
    with tempfile.TemporaryDirectory(prefix="static-bench-") as tmp:
        port_file = os.path.join(tmp, "echo.port")
        echo = subprocess.Popen([sys.executable, __file__, "--echo-server", port_file])
        server = _start_static(os.path.join(tmp, "data"))
        target = server.relay_url.removeprefix("grpc://")
        assert server.proc is not None
        server_pid = server.proc.pid
        try:
            while not os.path.exists(port_file) or not Path(port_file).read_text():
                time.sleep(0.05)
            echo_target = f"127.0.0.1:{Path(port_file).read_text()}"
            n = args.messages
            fsync_ms = commit_cost(tmp)
            ceiling, echo_rtt = echo_ceiling(echo_target, n)
            batched_rate, cpu_us = batched(target, server_pid, "bench/batch/one", n)
            ack, delivery, single_cpu_us = single_latency(
                target, server_pid, "bench/single/one", 1000
            )
            unary = unary_latency(target, "bench/unary/one", 2000)
            if not args.only_new:
                one = fan_out(target, "bench/one/one", n, 1)
                ten = fan_out(target, "bench/fan/out", n // 4, 10)
                p50, p99 = latency(target, "bench/lat/ency", 1000.0, 5.0)
                per_idle, total_mib = idle_rss(target, server_pid, "bench/idle/subs", args.idle)
        finally:
            server.stop(30)
            echo.kill()
            echo.wait(10)
    rows = [
        (
            "echo ceiling (bare purerpc stream)",
            f"{ceiling:,.0f} msg/s, ping-pong p50 {echo_rtt:.3f} ms",
        ),
        ("one durable commit (the floor)", f"p50 {fsync_ms:.3f} ms (SQLite, synchronous=FULL)"),
        (
            "1 -> 1 batched (64/batch, max_batch 256)",
            f"{batched_rate:,.0f} msg/s, relay CPU {cpu_us:.1f} us/msg (target <= 40)",
        ),
        (
            "one message: publish -> ack",
            f"p50 {ack[0]:.3f} ms, p99 {ack[1]:.3f} ms (PublishBatches, 1 item, every 5 ms)",
        ),
        (
            "one message: publish -> delivery",
            f"p50 {delivery[0]:.3f} ms, p99 {delivery[1]:.3f} ms (targets 0.3 / 1 ms)",
        ),
        ("one message: relay CPU", f"{single_cpu_us:.0f} us/msg (including keep-alives)"),
        ("unary Publish", f"p50 {unary[0]:.3f} ms, p99 {unary[1]:.3f} ms (target p50 <= 0.5 ms)"),
    ]
    if not args.only_new:
        rows += [
            ("1 -> 1 durable", f"{one:,.0f} msg/s = {one / ceiling:.0%} of echo (target >= 5,000)"),
            (
                "1 -> 10 fan-out",
                f"{ten:,.0f} deliveries/s = {ten / ceiling:.0%} of echo (target >= 20,000)",
            ),
            (
                "latency at 1,000 msg/s",
                f"p50 {p50:.2f} ms, p99 {p99:.2f} ms = {p50 / echo_rtt:.1f}x /"
                f" {p99 / echo_rtt:.1f}x the echo round trip (targets 1 / 5 ms)",
            ),
            (
                f"{args.idle:,} idle subscribers",
                f"{per_idle:,.1f} KiB each, server RSS {total_mib:,.0f} MiB (target <= 100 KiB)",
            ),
        ]
    print("relay benchmark: 1 KiB messages, loopback, SQLite synchronous=FULL")
    for name, figure in rows:
        print(f"  {name:<42} {figure}")


if __name__ == "__main__":
    main()
