"""Request/reply round trip against the send-based round trip of ``bench/e2e.py``, in one run.

    .venv/bin/python bench/request.py [--round-trips N] [--rounds N]

Starts a real ``static serve`` (anonymous, no publish rate limit, embedded SQLite, durable) on
loopback and two agents in separate processes; 1 KiB payloads. Prints figures, asserts nothing.

* **send-based** (the baseline, as ``bench/e2e.py`` measures it): Alice ``send``s, Bob's
  ``messages()`` loop ``send``s each message back, Alice ``receive``s it;
* **request/reply**: Alice's ``Channel.request(payload, timeout)``, Bob's ``requests()`` loop
  ``reply``-ing each one. A request is recorded in Alice's ``data_dir`` before it is sent and
  its reply kept until it is returned (exactly once across retries and crashes), which the
  baseline does not do.

The two are measured in alternating rounds (``--rounds``, ``--round-trips`` each), so the
machine's noise falls on both alike: median and p99 of each, and their ratio.
"""

from __future__ import annotations

import sys
from pathlib import Path

# bench/ also holds http.py (the HTTP API benchmark): keep it from shadowing the stdlib's http.
# ruff: noqa: E402
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import argparse
import multiprocessing as mp
import statistics
import tempfile
import time
from multiprocessing.connection import Connection

from tests.support.server import ServerProcess

PAYLOAD = 1024
CHANNEL = "bench/request/channel"
TIMEOUT = 30.0


def bob(relay: str, data_dir: str, conn: Connection) -> None:
    """The answering agent: echoes messages, or replies to requests, as told."""
    from static_sdk import StaticClient

    with StaticClient(relay, data_dir, b"bob") as client:
        conn.send(client.generate_key_package())
        channel = client.join_channel(CHANNEL, conn.recv())
        conn.send("joined")
        messages = channel.messages()
        requests = channel.requests()
        while True:
            command = conn.recv()
            if command == "stop":
                return
            kind, count = command
            for _ in range(count):
                if kind == "echo":
                    channel.send(next(messages))
                else:
                    request = next(requests)
                    request.reply(request.payload)
            conn.send("done")


def _p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def run(relay: str, tmp: Path, round_trips: int, rounds: int) -> None:
    from static_sdk import StaticClient

    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    far = ctx.Process(target=bob, args=(relay, str(tmp / "bob"), theirs))
    far.start()
    try:
        with StaticClient(relay, tmp / "alice", b"alice") as client:
            channel = client.create_channel(CHANNEL)
            ours.send(channel.add_member(ours.recv()))
            assert ours.recv() == "joined"
            payload = b"x" * PAYLOAD
            sent: list[float] = []
            requested: list[float] = []
            for _ in range(rounds):
                ours.send(("echo", round_trips))
                for _ in range(round_trips):
                    started = time.perf_counter()
                    channel.send(payload)
                    channel.receive(TIMEOUT)
                    sent.append(time.perf_counter() - started)
                assert ours.recv() == "done"
                ours.send(("reply", round_trips))
                for _ in range(round_trips):
                    started = time.perf_counter()
                    channel.request(payload, TIMEOUT)
                    requested.append(time.perf_counter() - started)
                assert ours.recv() == "done"
            ours.send("stop")
    finally:
        far.join(30)
        if far.is_alive():
            far.kill()
    base = statistics.median(sent)
    print(f"round trips, {rounds} alternating rounds of {round_trips} each:")
    print(f"  send-based      median {base * 1e3:6.2f} ms  p99 {_p99(sent) * 1e3:6.2f} ms")
    median = statistics.median(requested)
    print(
        f"  request/reply   median {median * 1e3:6.2f} ms  p99 {_p99(requested) * 1e3:6.2f} ms"
        f"  x{median / base:.2f} the send-based round trip"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--round-trips", type=int, default=200, help="per round (default 200)")
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds (default 4)")
    args = parser.parse_args()
    if args.round_trips < 1 or args.rounds < 1:
        parser.error("--round-trips and --rounds must be >= 1")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="static-request-") as tmp:
        server = ServerProcess(
            Path(tmp) / "server",
            extra_args=["--allow-anonymous", "--relay-publish-rate", "0"],
        ).start()
        try:
            run(server.relay_url, Path(tmp), args.round_trips, args.rounds)
        finally:
            server.stop()
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
