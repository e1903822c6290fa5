"""Removal on revocation: API key revoked -> the last real member's epoch change (the relay's
Remove proposal committed by a member), against group size.

    .venv/bin/python bench/revoke.py [--sizes 2,128] [--repeat N] [--observers K]

Starts a real ``static serve`` (tokens required, embedded SQLite, temporary data directory,
loopback, no publish rate limit; stopped at the end). One account: the creator (alice) and up
to ``--observers`` other real members share its first key; each victim joins on a key of its
own. Prints figures, asserts nothing.

At each group size N, the group is grown to N - 1 leaves (alice, the observers, then synthetic
key packages from ``static._native.bench``: throwaway identities that never join or commit).
Then, ``--repeat`` times, a fresh victim (a real ``StaticClient`` on a new key) joins (untimed;
N members), its key is revoked over HTTP (``DELETE /v1/keys/:id``) and the time is taken from
the DELETE's answer until every real member (alice and the observers) is at the next epoch
with the victim gone. What it covers: the relay's removal pass (every 2 s, or at once when the
authority reports the revocation), the proposal through the log, a member's commit of it (the
members race; the relay takes one) and its delivery to the others.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

# bench/ also holds http.py (the HTTP API benchmark): keep it from shadowing the stdlib's http.
# ruff: noqa: E402
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

from static._native import bench as native_bench
from static_sdk import Channel, StaticClient
from tests.support.api import Api
from tests.support.server import ServerProcess

CHANNEL = "bench/revoke/group"
WAIT = 60.0


def _ms(samples: list[float]) -> str:
    ordered = sorted(samples)
    p90 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))]
    return f"{statistics.median(samples) * 1000:8.1f} ms (p90 {p90 * 1000:.1f})"


def _grow(channel: Channel, leaves: int) -> None:
    """Adds synthetic members until the group has ``leaves`` leaves."""
    missing = leaves - len(channel.members())
    for package in native_bench.synthetic_key_packages(max(0, missing)):
        channel.add_member(package)


def _wait_all(channels: list[Channel], epoch: int, victim: bytes) -> None:
    deadline = time.monotonic() + WAIT
    for channel in channels:
        while channel.epoch() < epoch or victim in channel.members():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{channel.name}: the victim was not removed in {WAIT} s")
            time.sleep(0.002)


def run(server: ServerProcess, tmp: Path, sizes: list[int], repeat: int, observers: int) -> None:
    api = Api(server.http_url)
    account = api.signup()
    url = server.http_url
    with StaticClient(server.relay_url, tmp / "alice", b"alice", account.key, url) as alice:
        channel = alice.create_channel(CHANNEL)
        members: list[StaticClient] = []
        channels = [channel]
        for i in range(observers):
            client = StaticClient(
                server.relay_url, tmp / f"o{i}", f"obs-{i}".encode(), account.key, url
            )
            members.append(client)
            channels.append(
                client.join_channel(CHANNEL, channel.add_member(client.generate_key_package()))
            )
        sample = 0
        try:
            for size in sizes:
                _grow(channel, size - 1)
                taken: list[float] = []
                for _ in range(repeat):
                    sample += 1
                    identity = f"victim-{sample}".encode()
                    key = api.create_key(account.key, name=identity.decode())
                    with StaticClient(
                        server.relay_url, tmp / f"v{sample}", identity, key["key"], url
                    ) as victim:
                        welcome = channel.add_member(victim.generate_key_package())
                        victim.join_channel(CHANNEL, welcome)
                        epoch = max(c.epoch() for c in channels)
                        _wait_all(channels, epoch, b"")
                        response = api.revoke(account.key, key["id"])
                        t0 = time.perf_counter()
                        assert response.status_code == 204, response.text
                        _wait_all(channels, epoch + 1, identity)
                        taken.append(time.perf_counter() - t0)
                print(
                    f"group size {size} ({repeat} samples, {len(channels)} real members): "
                    f"revoke -> last member's epoch change {_ms(taken)}",
                    flush=True,
                )
        finally:
            for client in members:
                client.close()
            api.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", default="2,128", help="group sizes N >= 2 (default %(default)s)")
    parser.add_argument("--repeat", type=int, default=5, help="samples per size (default 5)")
    parser.add_argument(
        "--observers", type=int, default=3, help="real members besides alice (default 3)"
    )
    args = parser.parse_args()
    sizes = sorted({int(n) for n in args.sizes.split(",") if n.strip()})
    if not sizes or sizes[0] < 2 or args.repeat < 1 or args.observers < 0:
        parser.error("--sizes must be >= 2, --repeat >= 1, --observers >= 0")
    # Real members and the victim count in the group's size.
    observers = min(args.observers, sizes[0] - 2)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="static-revoke-") as tmp:
        server = ServerProcess(
            Path(tmp) / "server", extra_args=["--relay-publish-rate", "0"]
        ).start()
        try:
            run(server, Path(tmp), sizes, args.repeat, observers)
        finally:
            server.stop()
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
