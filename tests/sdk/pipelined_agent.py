"""A sending agent in its own process, for the outbox's kill tests.

Usage: python -m tests.sdk.pipelined_agent RELAY DATA_DIR IDENTITY CHANNEL TOTAL

Reopens CHANNEL from DATA_DIR and sends messages ``b"%06d" % i`` with ``send_pipelined`` for i
from where the channel's ``pipelined_count()`` says it stopped up to TOTAL, then flushes. It
never resends: what an earlier run's ``send_pipelined`` accepted is counted, and its outbox
sends it. Prints ``ready <first i>``, ``at <i>`` every 500 messages (then waits for a line on
stdin, so that the test may kill it within a few hundred messages of a point it chooses), and
``done`` (flushed).
"""

from __future__ import annotations

import sys

from static_sdk import StaticClient

PROGRESS_EVERY = 500


def main() -> None:
    relay, data_dir, identity, name, total = sys.argv[1:6]
    with StaticClient(relay, data_dir, identity.encode()) as client:
        channel = client.open_channel(name)
        first = channel.pipelined_count()
        print(f"ready {first}", flush=True)
        for i in range(first, int(total)):
            channel.send_pipelined(b"%06d" % i)
            if i % PROGRESS_EVERY == 0:
                print(f"at {i}", flush=True)
                sys.stdin.readline()
        channel.flush(60)
        print("done", flush=True)


if __name__ == "__main__":
    main()
