"""Retention benchmark: prints figures, asserts nothing.

    .venv/bin/python bench/retention.py [--entries N] [--batch N] [--repeat N]

Starts a real ``static serve`` (SQLite, durable; anonymous relay, no publish rate limit, the
pruner every 0.2 s, no idempotency window), fills one channel's log with N 1 KiB entries, then
gives it a policy that keeps one entry and measures, while the background pruner removes the
rest in steps of ``--batch`` entries (``--relay-prune-batch``):

* how long pruning takes (entries/s);
* the latency of unary Publish on another channel meanwhile (p50, p99, max), against the same
  figure just before (the pruner must never stall publishes: each step is one short transaction
  between two group commits);
* the relay's disk: the database's used bytes (pages not on SQLite's free list) before and
  after. SQLite keeps the file's size and reuses the freed pages; the used bytes are what the
  log holds.

``relay_disk_bytes`` and ``set_retention`` are what ``bench/scale.py`` needs for "relay disk before
and after pruning under a 1-hour policy" (``set_retention(target, channel, max_age_seconds=3600)``;
entries older than that go at the next pass).
"""

from __future__ import annotations

import sys
from pathlib import Path

# ruff: noqa: E402
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import argparse
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Iterator

import grpc

from static.store import relay_database, sqlite_url
from tests.relay._generated import relay_pb2 as pb
from tests.relay._generated import relay_pb2_grpc as pb_grpc
from tests.relay.client import anonymous_create_request
from tests.relay.mls_vectors import sized_application
from tests.support.server import ServerProcess

PAYLOAD = 1024


def stub(target: str) -> pb_grpc.RelayStub:
    channel = grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
    return pb_grpc.RelayStub(channel)  # type: ignore[no-untyped-call]


def create_channel(relay: pb_grpc.RelayStub, channel: str) -> None:
    """Creates ``channel`` from a real MLS group, bound to the anonymous account."""
    relay.CreateChannel(anonymous_create_request(channel), timeout=10)


def fill(relay: pb_grpc.RelayStub, channel: str, count: int, size: int = 256) -> None:
    """``count`` 1 KiB entries on ``channel`` (PublishBatches, pipelined)."""

    def batches() -> Iterator[pb.PublishBatchRequest]:
        for start in range(0, count, size):
            yield pb.PublishBatchRequest(
                requests=[
                    pb.PublishRequest(
                        channel=channel, message=sized_application(channel, b"%d" % i, PAYLOAD)
                    )
                    for i in range(start, min(count, start + size))
                ]
            )

    for _ in relay.PublishBatches(batches(), timeout=3600):
        pass


def set_retention(
    relay: pb_grpc.RelayStub,
    channel: str,
    *,
    max_age_seconds: int | None = None,
    max_entries: int | None = None,
    max_bytes: int | None = None,
    metadata: list[tuple[str, str]] | None = None,
) -> pb.RetentionResponse:
    """SetRetention as the channel's org owner (anonymous here unless ``metadata`` says)."""
    policy = pb.RetentionPolicy(
        max_age_seconds=max_age_seconds, max_entries=max_entries, max_bytes=max_bytes
    )
    request = pb.SetRetentionRequest(channel=channel, policy=policy)
    response: pb.RetentionResponse = relay.SetRetention(request, timeout=10, metadata=metadata)
    return response


def horizon(relay: pb_grpc.RelayStub, channel: str) -> int:
    response = relay.GetRetention(pb.GetRetentionRequest(channel=channel), timeout=10)
    return int(response.horizon_seq)


def relay_disk_bytes(database: Path) -> int:
    """The bytes a SQLite database's pages hold (the file less its free pages) plus its WAL."""
    with sqlite3.connect(f"file:{database}?mode=ro", uri=True) as conn:
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        free = conn.execute("PRAGMA freelist_count").fetchone()[0]
    wal = Path(f"{database}-wal")
    return int((pages - free) * page_size + (wal.stat().st_size if wal.exists() else 0))


def publish_latencies(
    relay: pb_grpc.RelayStub, channel: str, until: float, stop: list[bool]
) -> list[float]:
    """Unary Publish latencies (ms) until ``until`` (monotonic) or ``stop[0]``."""
    out = []
    i = 0
    while time.monotonic() < until and not stop[0]:
        message = sized_application(channel, b"probe %d" % i, PAYLOAD)
        started = time.perf_counter()
        relay.Publish(pb.PublishRequest(channel=channel, message=message), timeout=10)
        out.append((time.perf_counter() - started) * 1000)
        i += 1
    return out


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(entries: int, batch: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="bench-retention-") as tmp:
        server = ServerProcess(
            Path(tmp),
            None,
            extra_args=[
                "--allow-anonymous",
                "--relay-publish-rate",
                "0",
                "--relay-prune-interval",
                "0.2",
                "--relay-idempotency-window",
                "0",
                "--relay-prune-batch",
                str(batch),
            ],
        ).start()
        try:
            target = server.relay_url.removeprefix("grpc://")
            relay = stub(target)
            log, live = "bench/prune/log", "bench/prune/live"
            create_channel(relay, log)
            create_channel(relay, live)
            fill(relay, log, entries)
            database = Path(relay_database(sqlite_url(str(Path(tmp) / "static.db"))))
            disk_before = relay_disk_bytes(database)
            quiet = publish_latencies(relay, live, time.monotonic() + 2.0, [False])

            set_retention(relay, log, max_entries=1)
            started = time.monotonic()
            during: list[float] = []
            while horizon(relay, log) < entries - 1:
                during += publish_latencies(relay, live, time.monotonic() + 0.25, [False])
                if time.monotonic() - started > 600:
                    break
            took = time.monotonic() - started
            time.sleep(0.5)  # a checkpoint moves the WAL's pages into the file
            disk_after = relay_disk_bytes(database)
        finally:
            server.stop(30)
    return {
        "prune s": took,
        "prune entries/s": (entries - 1) / took,
        "publish p50 quiet ms": statistics.median(quiet),
        "publish p99 quiet ms": _p(quiet, 0.99),
        "publish max quiet ms": max(quiet),
        "publish p50 pruning ms": statistics.median(during),
        "publish p99 pruning ms": _p(during, 0.99),
        "publish max pruning ms": max(during),
        "publishes during pruning": float(len(during)),
        "disk before MiB": disk_before / 2**20,
        "disk after MiB": disk_after / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    runs = [run(args.entries, args.batch) for _ in range(args.repeat)]
    print(f"retention: {args.entries:,} entries of 1 KiB pruned to 1, steps of {args.batch:,}")
    for key in runs[0]:
        values = [r[key] for r in runs]
        spread = f" (min {min(values):,.2f}, max {max(values):,.2f})" if len(values) > 1 else ""
        print(f"  {key:<28} {statistics.median(values):>12,.2f}{spread}")


if __name__ == "__main__":
    main()
