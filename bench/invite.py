"""Invitations through the relay: invite -> accepted latency against group size, with the spec's
hand-carried flow (``add_member`` + ``join_channel``) measured in the same run as the baseline.

    .venv/bin/python bench/invite.py [--sizes 2,128] [--repeat N]

Starts a real ``static serve --allow-anonymous`` (embedded SQLite, temporary data directory,
loopback, no publish rate limit; stopped at the end). All agents are anonymous, so one account:
the default invitation policy admits them. Prints figures, asserts nothing.

At each group size N (members after the add, inviter included), the inviter's group is grown
first to N - 1 leaves with synthetic key packages (``static._native.bench``: throwaway
identities that never join). Then, ``--repeat`` times each, with a fresh invitee (a real
``StaticClient`` whose first ``invitations()`` has listed its key packages, untimed):

* **invite**: ``Channel.invite(address)``: the claim from the directory, the commit (Welcome
  with it) and the relay's invitation;
* **discovery**: from invite's return until the invitee's ``invitations()``, waiting in a
  thread since before the invite, yields it (its call waits at the relay, which answers it
  when the invitation is recorded);
* **accept**: ``Invitation.accept()``: the Welcome fetched, joined, the leaf bound, settled;
* baseline, **add + join**: ``add_member`` of a key package the invitee generated before the
  timer, then ``join_channel`` with the Welcome handed over in-process.

After each sample the invitee is removed (untimed), so every sample is taken at N members.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

# bench/ also holds http.py (the HTTP API benchmark): keep it from shadowing the stdlib's http.
# ruff: noqa: E402
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

from static._native import bench as native_bench
from static_sdk import Channel, Invitation, StaticClient
from tests.support.server import ServerProcess

CHANNEL = "bench/invite/group"


def _ms(samples: list[float]) -> str:
    return f"{statistics.median(samples) * 1000:8.1f} ms (p90 {_p90(samples) * 1000:.1f})"


def _p90(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))]


def _next_timed(
    invitations: Iterator[Invitation[Channel]], seen: list[tuple[float, Invitation[Channel]]]
) -> None:
    invitation = next(invitations)
    seen.append((time.perf_counter(), invitation))


def _grow(channel: Channel, leaves: int) -> None:
    """Adds synthetic members until the group has ``leaves`` leaves."""
    missing = leaves - len(channel.members())
    for package in native_bench.synthetic_key_packages(max(0, missing)):
        channel.add_member(package)


def run(relay: str, tmp: Path, sizes: list[int], repeat: int) -> None:
    with StaticClient(relay, tmp / "inviter", b"inviter") as inviter:
        channel = inviter.create_channel(CHANNEL)
        sample = 0
        for size in sizes:
            _grow(channel, size - 1)
            invite: list[float] = []
            discovery: list[float] = []
            accept: list[float] = []
            add_join: list[float] = []
            for _ in range(repeat):
                sample += 1
                identity = f"invitee-{sample}".encode()
                with StaticClient(relay, tmp / f"i{sample}", identity) as invitee:
                    invitations = invitee.invitations()
                    address = invitee.address
                    # The invitee waits in its iterator, as an agent would, from before the
                    # invite: it finds the invitation at its next poll.
                    seen: list[tuple[float, Invitation[Channel]]] = []
                    waiter = threading.Thread(
                        target=_next_timed, args=(invitations, seen), daemon=True
                    )
                    waiter.start()
                    time.sleep(0.05)
                    t0 = time.perf_counter()
                    channel.invite(address)
                    t1 = time.perf_counter()
                    waiter.join(30)
                    t2, invitation = seen[0]
                    invitation.accept()
                    t3 = time.perf_counter()
                    invite.append(t1 - t0)
                    discovery.append(t2 - t1)
                    accept.append(t3 - t2)
                channel.remove_member(identity)
                sample += 1
                identity = f"joiner-{sample}".encode()
                with StaticClient(relay, tmp / f"j{sample}", identity) as joiner:
                    package = joiner.generate_key_package()
                    t0 = time.perf_counter()
                    welcome = channel.add_member(package)
                    joiner.join_channel(CHANNEL, welcome)
                    add_join.append(time.perf_counter() - t0)
                channel.remove_member(identity)
            direct = [i + a for i, a in zip(invite, accept, strict=True)]
            total = [d + s for d, s in zip(direct, discovery, strict=True)]
            base = statistics.median(add_join)
            print(f"group size {size} ({repeat} samples each, median and p90):", flush=True)
            print(f"  invite                     {_ms(invite)}")
            print(f"  discovery                 {_ms(discovery)}")
            print(f"  accept                     {_ms(accept)}")
            print(
                f"  invite + accept            {_ms(direct)}  "
                f"x{statistics.median(direct) / base:.2f} the baseline"
            )
            print(
                f"  invite -> accepted         {_ms(total)}  "
                f"x{statistics.median(total) / base:.2f} the baseline"
            )
            print(f"  baseline add + join        {_ms(add_join)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", default="2,128", help="group sizes N >= 2 (default %(default)s)")
    parser.add_argument("--repeat", type=int, default=10, help="samples per size (default 10)")
    args = parser.parse_args()
    sizes = sorted({int(n) for n in args.sizes.split(",") if n.strip()})
    if not sizes or sizes[0] < 2 or args.repeat < 1:
        parser.error("--sizes must be >= 2 and --repeat >= 1")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="static-invite-") as tmp:
        server = ServerProcess(
            Path(tmp) / "server",
            extra_args=["--allow-anonymous", "--relay-publish-rate", "0"],
        ).start()
        try:
            run(server.relay_url, Path(tmp), sizes, args.repeat)
        finally:
            server.stop()
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
