"""A receiving agent in its own process, for the kill-and-restart test.

Usage: python -m tests.sdk.agent RELAY DATA_DIR IDENTITY CHANNEL WORKDIR STOP_AFTER

First run: writes a key package to WORKDIR/kp, waits for WORKDIR/welcome, joins. Later runs:
reopens the channel from DATA_DIR. Prints each received message on its own line (flushed), and
after STOP_AFTER messages stops reading (but stays alive, so its client keeps applying the log
in the background) until killed.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from static_sdk import StaticClient


def main() -> None:
    relay, data_dir, identity, name, workdir, stop_after = sys.argv[1:7]
    work = Path(workdir)
    client = StaticClient(relay, data_dir, identity.encode())
    if name in client.channels():
        channel = client.open_channel(name)
    else:
        (work / "kp.tmp").write_bytes(client.generate_key_package())
        (work / "kp.tmp").rename(work / "kp")
        deadline = time.monotonic() + 30
        while not (work / "welcome").exists():
            if time.monotonic() > deadline:
                sys.exit("no welcome")
            time.sleep(0.02)
        channel = client.join_channel(name, (work / "welcome").read_bytes())
    print("ready", flush=True)
    for count, message in enumerate(channel.messages(), start=1):
        print(message.decode(), flush=True)
        if count == int(stop_after):
            break
    print("idle", flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
