"""The relay's memory in a real ``static serve`` process: what busy channels cached is given
back to the OS once they go idle (``--relay-idle-unload``), and they carry on exactly when
used again. On both stores. (The figures at scale are ``bench/memory.py``'s.)"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from tests.relay import mls_vectors as mls
from tests.relay.client import Relay, pb
from tests.support.server import ServerProcess

Start = Callable[..., ServerProcess]
CHANNELS = 20
MESSAGES = 150
SIZE = 4096
MIB = 1024 * 1024


def _rss(server: ServerProcess) -> int:
    assert server.proc is not None
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _message(channel: str, i: int) -> bytes:
    return mls.application(channel, 0, f"{i}:".encode() + b"x" * SIZE)


def test_idle_channels_give_their_memory_back(start_server: Start) -> None:
    server = start_server("--allow-anonymous", "--relay-idle-unload", "0.3")
    names = [f"acme/memory/c{c}" for c in range(CHANNELS)]
    with Relay(server.relay_url) as relay:
        for name in names:
            relay.create(name)
        # A stream holds its channel loaded: without them, on a loaded machine (CI, beside
        # another test worker) the first channels went idle and were unloaded before the last
        # were published, and the busy figure missed them (7.2 MiB of growth was measured).
        holds = [relay.subscribe(name) for name in names]
        before = _rss(server)
        for name in names:
            batches = [
                [
                    pb.PublishRequest(channel=name, message=_message(name, i))
                    for i in range(s, s + 50)
                ]
                for s in range(0, MESSAGES, 50)
            ]
            answers = relay.publish_batches(batches)
            assert sum(len(a.results) for a in answers) == MESSAGES
        busy = _rss(server)
        growth = busy - before
        # ~12 MiB of messages were cached (within the 64 MiB default budget).
        assert growth > 8 * MIB, f"{growth / MIB:.1f} MiB"
        for hold in holds:
            hold.cancel()
        deadline = time.monotonic() + 20
        while _rss(server) - before > growth / 2:
            assert time.monotonic() < deadline, (
                f"RSS {before / MIB:.1f} MiB before, {busy / MIB:.1f} busy,"
                f" {_rss(server) / MIB:.1f} after 20 s idle"
            )
            time.sleep(0.2)
        # Loaded again from the store: the next seq, a retry's original one, the whole log.
        again = relay.publish(names[0], _message(names[0], MESSAGES))
        assert (again.seq, again.duplicate) == (MESSAGES + 1, False)
        retry = relay.publish(names[-1], _message(names[-1], 0))
        assert (retry.seq, retry.duplicate) == (1, True)
        sub = relay.subscribe(names[0], after_seq=MESSAGES - 2)
        assert [e.seq for e in sub.wait_for(3)] == [MESSAGES - 1, MESSAGES, MESSAGES + 1]
        sub.cancel()
