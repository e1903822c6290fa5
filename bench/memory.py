"""Relay memory with busy and then idle channels: prints figures, asserts nothing.

    .venv/bin/python bench/memory.py [--channels 10,100,1000] [--sizes 1024,4096]
                                     [--messages N] [--idle S] [--wait S] [--repeat N]

For each message size and number of channels, in turn, starts a real ``static serve
--allow-anonymous`` (SQLite, temporary data directory, loopback only, ports picked by the OS;
stopped at the end, on failure and on Ctrl-C too), then:

* creates the channels (real MLS groups, one engine in this process);
* publishes ``--messages`` messages of the size to every channel (PublishBatches, batches of 64,
  four channels at a time): the channels are *busy*;
* stops all traffic and waits ``--wait`` seconds (by default the relay's idle time plus a
  quarter, plus 5 s): the channels are *idle* and, since this release, unloaded.

It prints the server process's RSS (``VmRSS``, the HTTP API's Python included) at start, once
the channels are created, right after the traffic (busy) and after the wait (idle), and what is
left of the traffic's growth once idle. ``--idle S`` passes ``--relay-idle-unload S`` to the
server (a release without that flag: leave it out).
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
import statistics
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from static._native.mls import Engine
from tests.relay._generated import relay_pb2 as pb
from tests.relay.mls_vectors import sized_application
from tests.support.server import ServerProcess

SERVICE = "/static.relay.v1.Relay/"
MIB = 1024 * 1024
BATCH = 64
#: Channels published to at once.
PUBLISHERS = 4
#: The relay's idle time when ``--idle`` is not given (its default).
DEFAULT_IDLE = 60.0
_OPTIONS = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_send_message_length", 64 * MIB)]


def _rss(pid: int) -> int:
    """The process's resident set in bytes (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def create_channels(target: str, names: list[str]) -> None:
    """Creates ``names`` from real MLS groups of one engine (the anonymous account's)."""
    create = grpc.insecure_channel(target, options=_OPTIONS).unary_unary(
        SERVICE + "CreateChannel",
        request_serializer=pb.CreateChannelRequest.SerializeToString,
        response_deserializer=pb.CreateChannelResponse.FromString,
    )
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as directory:
        engine = Engine(directory, b"bench-memory")
        try:
            for name in names:
                engine.create_group(name)
                group_info, ratchet_tree = engine.public_state(name)
                leaf, signature = engine.leaf_binding(name, "")
                request = pb.CreateChannelRequest(
                    channel=name,
                    group_info=group_info,
                    ratchet_tree=ratchet_tree,
                    binding=pb.LeafBinding(leaf_index=leaf, signature=signature),
                )
                create(request, timeout=30)
        finally:
            engine.close()


def publish(target: str, name: str, count: int, size: int) -> int:
    """Publishes ``count`` messages of ``size`` bytes to ``name``; how many were accepted."""
    with grpc.insecure_channel(target, options=_OPTIONS) as channel:
        publish_batches = channel.stream_stream(
            SERVICE + "PublishBatches",
            request_serializer=pb.PublishBatchRequest.SerializeToString,
            response_deserializer=pb.PublishBatchResponse.FromString,
        )

        def batches() -> Iterator[pb.PublishBatchRequest]:
            for start in range(0, count, BATCH):
                yield pb.PublishBatchRequest(
                    requests=[
                        pb.PublishRequest(
                            channel=name, message=sized_application(name, f"m{i}".encode(), size)
                        )
                        for i in range(start, min(count, start + BATCH))
                    ]
                )

        accepted = 0
        for response in publish_batches(batches(), timeout=600):
            accepted += sum(1 for r in response.results if r.WhichOneof("outcome") == "accepted")
        return accepted


@dataclass
class Run:
    size: int
    channels: int
    start: int
    created: int
    busy: int
    idle: int
    #: Seconds from the end of the traffic until RSS came within 10% of the growth's floor.
    settled: float


def run_one(args: argparse.Namespace, size: int, channels: int) -> Run:
    extra = ["--allow-anonymous"]
    if args.idle is not None:
        extra += ["--relay-idle-unload", str(args.idle)]
    idle = DEFAULT_IDLE if args.idle is None else args.idle
    wait = args.wait if args.wait is not None else idle * 1.25 + 5
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        server = ServerProcess(Path(tmp) / "data", extra_args=extra).start()
        try:
            assert server.proc is not None
            pid = server.proc.pid
            target = server.relay_url.removeprefix("grpc://")
            time.sleep(1)
            start = _rss(pid)
            names = [f"bench/memory/s{size}-c{c}" for c in range(channels)]
            create_channels(target, names)
            created = _rss(pid)
            with ThreadPoolExecutor(PUBLISHERS) as pool:
                accepted = sum(pool.map(lambda n: publish(target, n, args.messages, size), names))
            if accepted != channels * args.messages:
                print(f"  (only {accepted} of {channels * args.messages} publishes accepted)")
            busy = _rss(pid)
            ended = time.monotonic()
            samples: list[tuple[float, int]] = []
            while time.monotonic() - ended < wait:
                time.sleep(1)
                samples.append((time.monotonic() - ended, _rss(pid)))
            idle_rss = samples[-1][1] if samples else _rss(pid)
            floor = min(r for _, r in samples) if samples else idle_rss
            near = floor + (busy - floor) / 10
            settled = next((t for t, r in samples if r <= near), wait)
            return Run(size, channels, start, created, busy, idle_rss, settled)
        finally:
            server.stop()


def show(run: Run) -> None:
    growth = run.busy - run.created
    left = run.idle - run.created
    kept = f"{100 * left / growth:5.0f}%" if growth > 0 else "    -"
    print(
        f"{run.size:>6} {run.channels:>8} {run.start / MIB:>9.1f} {run.created / MIB:>9.1f}"
        f" {run.busy / MIB:>9.1f} {run.idle / MIB:>9.1f} {kept:>7} {run.settled:>8.0f}",
        flush=True,
    )


def header() -> None:
    print(
        f"{'bytes':>6} {'channels':>8} {'start MiB':>9} {'created':>9} {'busy':>9} {'idle':>9}"
        f" {'kept':>7} {'settle s':>8}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--channels", default="10,100,1000")
    parser.add_argument("--sizes", default="1024,4096")
    parser.add_argument("--messages", type=int, default=400, help="per channel")
    parser.add_argument("--idle", type=float, default=None, help="--relay-idle-unload (s)")
    parser.add_argument("--wait", type=float, default=None, help="seconds idle before measuring")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    channel_counts = [int(c) for c in args.channels.split(",")]
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"{args.messages} messages per channel; RSS of the static serve process")
    header()
    runs: dict[tuple[int, int], list[Run]] = {}
    for _ in range(args.repeat):
        for size in sizes:
            for channels in channel_counts:
                run = run_one(args, size, channels)
                runs.setdefault((size, channels), []).append(run)
                show(run)
    if args.repeat > 1:
        print("\nmedians (busy, idle MiB) and spread (max - min):")
        for (size, channels), done in runs.items():
            busy = [r.busy / MIB for r in done]
            idle = [r.idle / MIB for r in done]
            print(
                f"{size:>6} {channels:>8}  busy {statistics.median(busy):7.1f}"
                f" ({max(busy) - min(busy):.1f})  idle {statistics.median(idle):7.1f}"
                f" ({max(idle) - min(idle):.1f})"
            )


if __name__ == "__main__":
    main()
